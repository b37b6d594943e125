"""build → prepare → attend: the OpenAttention decode estimator (DESIGN.md §1), composed of registered components.

    pipe = oa.build({"budget": {"density": 0.03}})
    state = pipe.prepare(keys, values, queries)     # once per request: cluster, pool sums, build the index
    out, stats = pipe.attend(query, state, return_stats=True)
    state.append(new_keys, new_values)              # decode-time growth
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import Tensor

from oa_core.components import (AllocationInput, Allocator, Clusterer, Clusters, Kernel, PooledClusters,
                                Selection, Selector)
from oa_core.registry import default_registry
from oa_core.spec import ComponentSpec, PipelineSpec, SpecError, describe, load_spec


def build(spec: PipelineSpec | Mapping | str | Path | None = None) -> Pipeline:
    """A Pipeline from a spec model, a mapping, or a YAML file path. Raises SpecError naming the field."""
    spec = load_spec(spec if spec is not None else {})
    kernel_spec, kernel_note = _resolve_kernel(spec.kernel)
    return Pipeline(
        spec,
        clusterer=_instantiate("clusterer", spec.clusterer),
        selector=_instantiate("selector", spec.selector),
        allocator=_instantiate("allocator", spec.allocator),
        kernel=_instantiate("kernel", kernel_spec),
        kernel_note=kernel_note,
    )


def _resolve_kernel(kernel: ComponentSpec) -> tuple[ComponentSpec, str]:
    if kernel.name != "auto":
        return kernel, f"kernel {kernel.name!r} requested"
    if default_registry().get("kernel", "flash") is not None and torch.cuda.is_available():
        return ComponentSpec(name="flash", params=kernel.params), "auto: flash (CUDA available)"
    return ComponentSpec(name="torch", params=kernel.params), "auto: torch reference (no flash kernel on this machine)"


def _instantiate(kind: str, component: ComponentSpec):
    info = default_registry().get(kind, component.name)
    if info is None:
        known = ", ".join(default_registry().names(kind)) or "none registered"
        raise SpecError(f"{kind}: unknown {kind} {component.name!r}; known: {known}")
    try:
        config = info.cls.Config.model_validate(component.params)
    except ValidationError as exc:
        raise SpecError(describe(exc, prefix=kind)) from None
    return info.cls(config)


@dataclass
class AttendStats:
    """What one attend call read. ``reads``/``proxies``: ``[B, Hkv, Gs, T]`` exact rows read and proxies used."""

    density: float
    num_tokens: int
    budget: int
    reads: Tensor
    proxies: Tensor | None
    dense: bool
    reason: str
    kernel: str


@dataclass
class PipelineState:
    """One layer's per-request state: the cache, its clusters with pooled sums, and the selector's index.

    keys/values ``[B, Hkv, N, D]``; ``assignment`` ``[B, Hkv, N]`` cluster per position, C for sink, local and
    positions not clustered; pooled sums in float32.
    """

    pipeline: Pipeline
    keys: Tensor
    values: Tensor
    scale: float
    dense_reason: str | None = None
    clusters: Clusters | None = None
    pooled: PooledClusters | None = None
    key_square_sum: Tensor | None = None
    index: Any = None
    clustered_end: int = 0
    _moments: tuple[Tensor, Tensor] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def num_clusters(self) -> int:
        return self.clusters.num_clusters if self.clusters is not None else 0

    def cluster_moments(self) -> tuple[Tensor, Tensor]:
        """Mean key k̄_b and diagonal variance Var_b(k), ``[B, Hkv, C, D]`` each, derived from the pooled sums."""
        if self._moments is None:
            n = self.pooled.count.clamp_min(1).unsqueeze(-1)
            mean = self.pooled.key_sum / n
            self._moments = mean, (self.key_square_sum / n - mean * mean).clamp_min(0)
        return self._moments

    def append(self, keys: Tensor, values: Tensor) -> None:
        """Decode-time growth: add ``[B, Hkv, t, D]`` rows; rows leaving the local window join their nearest cluster."""
        _check_cache(keys, values, like=self.keys, what="appended ")
        self.keys = torch.cat([self.keys, keys], dim=2)
        self.values = torch.cat([self.values, values], dim=2)
        if self.clusters is None:
            return
        pipe = self.pipeline
        self.index = pipe.selector.extend(self.index, keys)
        pad = torch.full(keys.shape[:3], self.num_clusters, dtype=torch.long, device=keys.device)
        assignment = torch.cat([self.pooled.assignment, pad], dim=2)
        leaving_end = self.num_tokens - pipe.spec.local
        if leaving_end > self.clustered_end:
            leaving = slice(self.clustered_end, leaving_end)
            ids = pipe.clusterer.assign(self.clusters, self.keys[:, :, leaving])
            assignment[:, :, leaving] = ids
            self._pool(ids, self.keys[:, :, leaving], self.values[:, :, leaving])
            self.clustered_end = leaving_end
        self.pooled.assignment = assignment
        self._moments = None

    def _pool(self, ids: Tensor, keys: Tensor, values: Tensor) -> None:
        """Add rows ``[B, Hkv, n, D]`` with cluster ids ``[B, Hkv, n]`` to the pooled sums."""
        k, v = keys.float(), values.float()
        rows = ids.unsqueeze(-1).expand_as(k)
        self.pooled.count.scatter_add_(-1, ids, torch.ones_like(ids, dtype=torch.float32))
        self.pooled.key_sum.scatter_add_(-2, rows, k)
        self.pooled.value_sum.scatter_add_(-2, rows, v)
        self.key_square_sum.scatter_add_(-2, rows, k * k)


class Pipeline:
    """A composed OpenAttention estimator. Build it with ``oa.build(spec)``."""

    def __init__(self, spec: PipelineSpec, clusterer: Clusterer, selector: Selector, allocator: Allocator,
                 kernel: Kernel, kernel_note: str = "") -> None:
        self.spec = spec
        self.clusterer = clusterer
        self.selector = selector
        self.allocator = allocator
        self.kernel = kernel
        self.kernel_note = kernel_note

    def __repr__(self) -> str:
        s = self.spec
        return (f"Pipeline({self.clusterer!r}, {self.selector!r}, {self.allocator!r}, {self.kernel!r}, "
                f"tail={s.tail}, budget={s.budget.model_dump(exclude_none=True)}, sink={s.sink}, local={s.local}, "
                f"gqa={s.gqa})")

    # -- once per request -------------------------------------------------------------------------------------

    def prepare(self, keys: Tensor, values: Tensor, queries: Tensor | None = None,
                scale: float | None = None) -> PipelineState:
        """Cluster the context and build the selector index.

        keys/values ``[B, Hkv, N, D]``; queries ``[B, Hq, M, D]``: prefill queries of this request (QGC's query
        geometry), optional; scale: the logit scale s, default 1/√D.
        """
        _check_cache(keys, values)
        if queries is not None:
            _check_query(queries, keys, "queries")
        scale = _check_scale(scale, keys.shape[-1])
        state = PipelineState(self, keys, values, scale)
        n = keys.shape[2]
        state.dense_reason = self._dense_reason(n, self.spec.budget.rows(n))
        if state.dense_reason is not None:
            return state

        sink, local = self.spec.sink, self.spec.local
        generator = torch.Generator().manual_seed(self.spec.seed)  # on the CPU: the same clusters on every device
        clusters = self.clusterer.fit(keys[:, :, sink:n - local], queries, generator)
        C = clusters.num_clusters
        assignment = torch.full(keys.shape[:3], C, dtype=torch.long, device=keys.device)
        assignment[:, :, sink:n - local] = clusters.assignment
        B, H, _, D = keys.shape
        zeros = keys.new_zeros(B, H, C, D, dtype=torch.float32)
        state.clusters = clusters
        state.pooled = PooledClusters(keys.new_zeros(B, H, C, dtype=torch.float32), zeros, zeros.clone(), assignment)
        state.key_square_sum = zeros.clone()
        state._pool(clusters.assignment, keys[:, :, sink:n - local], values[:, :, sink:n - local])
        state.clustered_end = n - local
        state.index = self.selector.build(keys, queries, clusters)
        return state

    def _dense_reason(self, num_tokens: int, budget: int) -> str | None:
        fixed = self.spec.sink + self.spec.local
        if budget >= num_tokens:
            return f"dense: budget of {budget} rows >= context of {num_tokens} tokens"
        if budget < fixed:
            raise SpecError(f"budget: {budget} rows ({self.spec.budget.model_dump(exclude_none=True)} of "
                            f"{num_tokens} tokens) is smaller than sink + local = {fixed}")
        return None

    # -- per decode query -------------------------------------------------------------------------------------

    def attend(self, query: Tensor, state: PipelineState, return_stats: bool = False):
        """query ``[B, Hq, T, D]`` → output ``[B, Hq, T, D]`` (and AttendStats when ``return_stats``).

        Every one of the T queries sees all N cached rows.
        """
        if not isinstance(state, PipelineState) or state.pipeline is not self:
            raise ValueError("state: pass the PipelineState this pipeline's prepare() returned")
        _check_query(query, state.keys, "query")
        keys, values, scale = state.keys, state.values, state.scale
        n = state.num_tokens
        budget = self.spec.budget.rows(n)
        reason = state.dense_reason or self._dense_reason(n, budget)
        dense = reason is not None
        if dense:
            out, proxies = self.kernel.attend(query, keys, values, None, None, scale)
            reads = torch.full((*keys.shape[:2], 1, query.shape[2]), n, device=query.device)
        else:
            selection = self._select(query, state, budget)
            proxies_in = state.pooled if self.spec.tail == "proxy" else None
            out, proxies = self.kernel.attend(query, keys, values, selection, proxies_in, scale)
            reads = selection.valid.sum(-1)
            reason = f"sparse: {self.spec.tail} tail"
        if not return_stats:
            return out
        stats = AttendStats(density=float(reads.float().mean()) / n, num_tokens=n, budget=min(budget, n),
                            reads=reads, proxies=proxies, dense=dense,
                            reason=reason, kernel=f"{self.kernel.name} ({self.kernel_note})")
        return out, stats

    def _select(self, query: Tensor, state: PipelineState, budget: int) -> Selection:
        """Steps 4–6 of DESIGN.md §1, plus tail samples: the exact rows of every (query, selection head)."""
        spec = self.spec
        B, Hq, T, D = query.shape
        Hkv, n = state.keys.shape[1], state.num_tokens
        g = Hq // Hkv
        q = query.float().reshape(B, Hkv, g, T, D)

        key_mean, key_var = state.cluster_moments()
        mean_logit = state.scale * torch.einsum("bhgtd,bhcd->bhgtc", q, key_mean)
        logit_var = state.scale ** 2 * torch.einsum("bhgtd,bhcd->bhgtc", q * q, key_var)

        scores = self.selector.score(query, state.index, state.keys, state.scale).view(B, Hkv, g, T, n)
        if spec.gqa == "shared":
            scores = scores.amax(dim=2, keepdim=True)
        assignment = state.pooled.assignment
        clusterable = (assignment < state.num_clusters)[:, :, None, None, :]
        scores = scores.masked_fill(~clusterable, -math.inf)

        selectable = budget - spec.sink - spec.local
        samples = round(spec.tail_samples * selectable) if spec.tail == "sample" else 0
        inputs = AllocationInput(mean_logit, logit_var, state.pooled.count, scores, assignment, selectable - samples)
        quotas = self.allocator.allocate(inputs)
        chosen = self.selector.select(scores, assignment, quotas)

        fixed = torch.cat([torch.arange(spec.sink), torch.arange(state.clustered_end, n)]).to(query.device)
        index = torch.cat([fixed.expand(*chosen.shape[:-1], -1), chosen], dim=-1)
        log_weight = torch.zeros(index.shape, device=query.device)
        if samples:
            drawn, log_eta = self._sample_tail(clusterable, index, samples, state)
            index = torch.cat([index, drawn], dim=-1)
            log_weight = torch.cat([log_weight, log_eta.expand_as(drawn)], dim=-1)
        return Selection(index, log_weight)

    def _sample_tail(self, clusterable: Tensor, index: Tensor, samples: int, state: PipelineState):
        """m uniform samples without replacement from the unread clusterable rows, each weighted η = N_T/m."""
        n = state.num_tokens
        unread = torch.cat([clusterable.expand(*index.shape[:-1], n), clusterable.new_zeros(1).expand(
            *index.shape[:-1], 1)], dim=-1)
        unread.scatter_(-1, index.masked_fill(index < 0, n), False)  # padding goes to the spare column n
        unread = unread[..., :n]
        # A stream of its own per (seed, context length): clustering uses `seed` itself, and each decode step
        # resamples. Hashed to 32 bits, since the CPU generator ignores higher seed bits.
        stream = hashlib.sha256(f"tail-sample:{self.spec.seed}:{n}".encode()).digest()
        generator = torch.Generator(device=index.device).manual_seed(int.from_bytes(stream[:4], "little"))
        noise = torch.rand(unread.shape, generator=generator, device=index.device).masked_fill(~unread, -1.0)
        noise, drawn = noise.topk(samples, dim=-1)
        drawn = drawn.masked_fill(noise < 0, -1)
        tail = unread.sum(-1, keepdim=True).float()
        taken = (drawn >= 0).sum(-1, keepdim=True).clamp_min(1).float()
        return drawn, torch.log(tail / taken)


def _check_cache(keys: Tensor, values: Tensor, like: Tensor | None = None, what: str = "") -> None:
    for name, t in ((f"{what}keys", keys), (f"{what}values", values)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected shape [B, Hkv, N, D], got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    if keys.shape != values.shape:
        raise ValueError(f"{what}keys and values differ in shape: {tuple(keys.shape)} vs {tuple(values.shape)}")
    if keys.dtype != values.dtype or keys.device != values.device:
        raise ValueError(f"{what}keys ({keys.dtype}, {keys.device}) and values ({values.dtype}, {values.device}) "
                         "must share dtype and device")
    if like is not None and (keys.shape[:2] + keys.shape[3:] != like.shape[:2] + like.shape[3:]
                             or keys.dtype != like.dtype or keys.device != like.device):
        raise ValueError(f"{what}keys {tuple(keys.shape)} {keys.dtype} {keys.device} do not match the cache "
                         f"{tuple(like.shape)} {like.dtype} {like.device} (only N may differ)")
    for name, t in ((f"{what}keys", keys), (f"{what}values", values)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: the cache contains NaN or Inf")


def _check_query(query: Tensor, keys: Tensor, name: str) -> None:
    if not isinstance(query, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(query).__name__}")
    if query.dim() != 4:
        raise ValueError(f"{name}: expected shape [B, Hq, T, D], got {tuple(query.shape)}")
    B, Hkv, _, D = keys.shape
    if query.shape[0] != B or query.shape[3] != D:
        raise ValueError(f"{name}: batch and head dim {tuple(query.shape)} do not match the keys {tuple(keys.shape)}")
    if query.shape[1] % Hkv:
        raise ValueError(f"{name}: {query.shape[1]} query heads is not a multiple of {Hkv} KV heads")
    if query.dtype != keys.dtype or query.device != keys.device:
        raise ValueError(f"{name}: dtype/device {query.dtype}/{query.device} differ from the cache's "
                         f"{keys.dtype}/{keys.device}")
    if not bool(torch.isfinite(query).all()):
        raise ValueError(f"{name}: contains NaN or Inf")


def _check_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    return float(scale)
