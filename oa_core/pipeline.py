"""build → prepare → attend: the OpenAttention decode estimator (DESIGN.md §1), composed of registered components.

    pipe = oa.build({"budget": {"density": 0.03}})
    state = pipe.prepare(keys, values, queries)     # once per request: cluster, pool sums, build the index
    out, stats = pipe.attend(query, state, return_stats=True)
    state.append(new_keys, new_values)              # decode-time growth (or state.grow_to(cache_keys, cache_values))
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import Tensor

from oa_core.cluster_stats import cluster_logit_stats
from oa_core.components import (AllocationInput, Allocator, Clusterer, Clusters, Kernel, PooledClusters,
                                Selection, Selector, compact, positions, violation)
from oa_core.registry import default_registry
from oa_core.spec import ComponentSpec, PipelineSpec, SpecError, describe, load_spec


def build(spec: PipelineSpec | Mapping | str | Path | None = None) -> Pipeline:
    """A Pipeline from a spec model, a mapping, or a YAML file path. Raises SpecError naming the field."""
    spec = load_spec(spec if spec is not None else {})
    kernel_spec, kernel_note = _resolve_kernel(spec.kernel)
    selector = _instantiate("selector", spec.selector)
    if spec.tail == "sample" and spec.gqa == "shared" and type(selector).sample_pool is not Selector.sample_pool:
        raise SpecError(f"gqa: tail: sample with selector {selector.name!r} draws a pool per query head; "
                        "use gqa: per_head")
    return Pipeline(
        spec,
        clusterer=_instantiate("clusterer", spec.clusterer),
        selector=selector,
        allocator=_instantiate("allocator", spec.allocator),
        kernel=_instantiate("kernel", kernel_spec),
        kernel_note=kernel_note,
    )


def _resolve_kernel(kernel: ComponentSpec) -> tuple[ComponentSpec, str]:
    if kernel.name != "auto":
        return kernel, f"kernel {kernel.name!r} requested"
    if default_registry().get("kernel", "flash") is None:
        why = "no flash kernel registered (triton missing)"
    elif not torch.cuda.is_available():
        why = "no CUDA device"
    else:
        return ComponentSpec(name="flash", params=kernel.params), "auto: flash (CUDA available)"
    return ComponentSpec(name="torch", params=kernel.params), f"auto: torch reference ({why})"


def _instantiate(kind: str, component: ComponentSpec):
    info = default_registry().get(kind, component.name)
    if info is None:
        known = ", ".join(default_registry().names(kind)) or "none registered"
        raise SpecError(f"{kind}: unknown {kind} {component.name!r}; known: {known}")
    try:
        config = info.cls.Config.model_validate(component.params)
    except ValidationError as exc:
        raise SpecError(f"{describe(exc, prefix=kind)} ({kind} {component.name!r} from package {info.package!r})") \
            from None
    return info.cls(config)


@dataclass
class AttendStats:
    """What one attend call read. ``reads``/``proxies``: ``[B, Hkv, Gs, T]`` exact rows read and proxies used;
    ``density``: reads over each row's valid context length, averaged (kept on the device as ``density_tensor``
    until asked: building the stats never waits on it)."""

    density_tensor: Tensor
    num_tokens: int
    reads: Tensor
    proxies: Tensor | None
    dense: bool
    reason: str
    kernel: str

    @property
    def density(self) -> float:
        return float(self.density_tensor)


@dataclass
class ReadPlan:
    """Host-side facts of one cache state (``PipelineState.plan``): ``fixed`` ``[B, Hkv, F]`` positions read exactly
    at every step (-1 padded); ``selectable`` ``[B, Hkv, 1, 1]`` rows left for the selector and tail samples;
    ``max_selectable`` its maximum; ``all_dense``: every row reads its whole context; ``padded``: some position is
    padding; ``unclustered`` ``[B, Hkv, 1, 1, N]``: positions outside every cluster; ``members``: the clusters'
    positions and sizes for the GPU's per-cluster selection (CUDA caches only), with ``largest_bound`` ≥ the largest
    cluster; ``lengths`` ``[B]``, ``fixed_counts`` ``[B, Hkv]`` and ``dense_rows`` ``[B]``: on the CPU, so that growth
    updates the plan without waiting on the device."""

    fixed: Tensor
    selectable: Tensor
    max_selectable: int
    padded: bool
    lengths: Tensor
    fixed_counts: Tensor
    dense_rows: Tensor
    unclustered: Tensor | None = None
    members: tuple[Tensor, Tensor] | None = None
    largest_bound: int = 0

    @property
    def all_dense(self) -> bool:
        return bool(self.dense_rows.all())


def probe_rows(n: int) -> list[int]:
    """The rows of an n-row cache compared to tell it from another cache of that length: first, a third, half, last."""
    return sorted({0, n // 3, n // 2, n - 1}) if n else []


class CacheMismatch(ValueError):
    """``grow_to`` was given a cache whose first rows are not the state's own."""


@dataclass
class PipelineState:
    """One layer's per-request state: the cache, its clusters with pooled sums, and the selector's index.

    keys/values ``[B, Hkv, N, D]``; ``valid`` ``[B, N]`` (False: padding, never read, never clustered);
    ``dense_rows`` ``[B]``: rows read in full because the budget covers them; ``pooled.assignment`` ``[B, Hkv, N]``
    gives each position's cluster, C for the rows read exactly every time (sink, local window, dense rows) and for
    padding. Pooled sums are float32. ``clusters`` is None when every row is dense.
    """

    pipeline: Pipeline
    keys: Tensor
    values: Tensor
    valid: Tensor
    scale: float
    dense_rows: Tensor
    clusters: Clusters | None = None
    pooled: PooledClusters | None = None
    index: Any = None
    clustered_end: int = 0
    _moments: tuple[Tensor, Tensor] | None = field(default=None, repr=False)
    _plan: ReadPlan | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def num_clusters(self) -> int:
        return self.clusters.num_clusters if self.clusters is not None else 0

    def exact_rows(self) -> Tensor:
        """``[B, Hkv, N]``: the valid positions read exactly at every step (sink, local window, dense rows)."""
        fixed = self.valid[:, None, :].expand(*self.keys.shape[:3])
        return fixed if self.clusters is None else fixed & (self.pooled.assignment == self.num_clusters)

    def plan(self) -> ReadPlan:
        """What every attend on this cache reads regardless of the query; built once per prepare (and updated by
        each growth), so that an attend itself never waits on the device (and can run inside a CUDA graph)."""
        if self._plan is None:
            fixed = self.exact_rows()
            fixed_counts = fixed.sum(-1).cpu()
            members, largest = None, 0
            if self.clusters is not None and _wants_members(self.keys):  # for the GPU's per-cluster selection
                from oa_core.selection import cluster_members

                members = cluster_members(self.pooled.assignment, self.num_clusters, room=MEMBER_ROOM)
                largest = int(members[1].max()) if members[1].numel() else 0
            self._plan = self._read_plan(positions(fixed), self.valid.sum(-1).cpu(), fixed_counts, members, largest,
                                         None if self.clusters is None else
                                         (self.pooled.assignment == self.num_clusters)[:, :, None, None, :],
                                         self.dense_rows.cpu(), not bool(self.valid.all()))
        return self._plan

    def _read_plan(self, fixed: Tensor, lengths: Tensor, fixed_counts: Tensor, members, largest: int,
                   unclustered: Tensor | None, dense: Tensor, padded: bool) -> ReadPlan:
        """A ReadPlan from its parts; the budget's split follows from the host-side lengths and counts."""
        selectable = torch.zeros_like(fixed_counts)
        if self.clusters is not None:
            selectable = (self.pipeline.spec.budget.rows(lengths)[:, None] - fixed_counts).clamp_min(0)
            selectable = selectable.masked_fill(dense[:, None], 0)
        return ReadPlan(fixed=fixed, selectable=selectable[:, :, None, None].to(self.keys.device),
                        max_selectable=int(selectable.max()) if selectable.numel() else 0,
                        padded=padded, lengths=lengths, fixed_counts=fixed_counts,
                        dense_rows=dense, unclustered=unclustered, members=members, largest_bound=largest)

    def _grown_plan(self, plan: ReadPlan, added: int, leaving: slice | None, ids: Tensor | None) -> ReadPlan:
        """``plan`` after ``added`` rows were appended and the positions ``leaving`` joined the clusters ``ids``
        ``[B, Hkv, |leaving|]`` (C in dense rows): what ``plan()`` would build from scratch, updated in O(F + t) per
        row instead of sorting the context, without waiting on the device (but for enlarging the member table, rarely).
        """
        B, H = self.keys.shape[:2]
        n, C = self.num_tokens, self.num_clusters
        device = self.keys.device
        dense = plan.dense_rows
        fixed, unclustered, members, largest = plan.fixed, plan.unclustered, plan.members, plan.largest_bound
        fixed = torch.cat([fixed, torch.arange(n - added, n, device=device).expand(B, H, added)], dim=-1)
        left = 0
        if leaving is not None:  # (the rows leaving may include new ones, when more than the local window came)
            left = leaving.stop - leaving.start
            joined = (fixed >= leaving.start) & (fixed < leaving.stop) & ~self.dense_rows[:, None, None]
            fixed = fixed.masked_fill(joined, -1)
        fixed_counts = plan.fixed_counts + added - left * (~dense).long()[:, None]
        fixed = compact(fixed, fixed >= 0, int(fixed_counts.max()) if fixed_counts.numel() else 0)
        if unclustered is not None:
            unclustered = torch.cat([unclustered, unclustered.new_ones(B, H, 1, 1, added)], dim=-1)
            if leaving is not None:
                unclustered[..., leaving] = (ids == C)[:, :, None, None, :]
        if members is not None and leaving is not None:
            from oa_core.selection import add_members, cluster_members

            largest += left
            if largest > members[0].shape[-1]:  # maybe full: the true largest decides (a device sync)
                largest = int(members[1].max()) + left
            if largest > members[0].shape[-1]:
                members = cluster_members(self.pooled.assignment, C, room=MEMBER_ROOM)
                largest = int(members[1].max())
            else:
                members = add_members(*members, ids, torch.arange(leaving.start, leaving.stop, device=device))
        return self._read_plan(fixed, plan.lengths + added, fixed_counts, members, largest, unclustered, dense,
                               plan.padded)

    def cluster_moments(self) -> tuple[Tensor, Tensor]:
        """Mean key k̄_b and diagonal variance Var_b(k), ``[B, Hkv, C, D]`` each, derived from the pooled sums."""
        if self._moments is None:
            n = self.pooled.count.clamp_min(1).unsqueeze(-1)
            mean = self.pooled.key_sum / n
            self._moments = mean, (self.pooled.key_square_sum / n - mean * mean).clamp_min(0)
        return self._moments

    def fork(self) -> PipelineState:
        """A copy that grows independently (``append`` replaces tensors, never writes into shared ones)."""
        pooled = dataclasses.replace(self.pooled) if self.pooled is not None else None
        return dataclasses.replace(self, pooled=pooled)

    def append(self, keys: Tensor, values: Tensor) -> None:
        """Decode-time growth: add ``[B, Hkv, t, D]`` rows; rows leaving the local window join their nearest cluster
        (rows of dense batch rows stay exact). The state keeps the concatenated cache; to follow a cache that grows
        by itself (transformers'), without a second copy, use ``grow_to``."""
        _check_cache(keys, values, like=self.keys, what="appended ")
        self._grow(torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2))

    def grow_to(self, keys: Tensor, values: Tensor) -> None:
        """Decode-time growth without copying the cache: ``keys``/``values`` ``[B, Hkv, N', D]`` are the whole cache
        after it grew (a cache's own tensors, or views of them), their first N rows the ones this state holds. The
        state reads them in place from then on; only the new rows are checked (shape, dtype, device, NaN/Inf)."""
        n = self.num_tokens
        if not isinstance(keys, Tensor) or not isinstance(values, Tensor) or keys.dim() != 4 or keys.shape[2] < n:
            raise ValueError(f"grow_to: expected the grown cache [B, Hkv, N' >= {n}, D], got "
                             f"{tuple(getattr(keys, 'shape', ()))}")
        new_keys, new_values = keys[:, :, n:], values[:, :, n:]
        _check_cache(new_keys, new_values, like=self.keys, what="appended ", finite=False)
        # The new rows finite and known rows unchanged (a few, spread, the last included), in one wait: grow_to runs
        # at every decode step.
        ok = torch.isfinite(new_keys).all() & torch.isfinite(new_values).all()
        known = probe_rows(n)
        if n:
            ok &= (keys[:, :, known] == self.keys[:, :, known]).all()
            ok &= (values[:, :, n - 1] == self.values[:, :, n - 1]).all()
        if not bool(ok):
            _check_cache(new_keys, new_values, what="appended ")  # raises when the new rows hold NaN/Inf
            raise CacheMismatch(f"grow_to: the grown cache's first rows are not this state's (compared at positions "
                                f"{', '.join(map(str, known))})")
        self._grow(keys, values)

    def _grow(self, keys: Tensor, values: Tensor) -> None:
        new_keys = keys[:, :, self.num_tokens:]
        self.keys, self.values = keys, values
        self.valid = torch.cat([self.valid, self.valid.new_ones(keys.shape[0], new_keys.shape[2])], dim=1)
        plan, self._plan = self._plan, None
        leaving, ids = None, None
        if self.clusters is not None:
            leaving, ids = self._cluster_new_rows(new_keys)
        if plan is not None:
            self._plan = self._grown_plan(plan, new_keys.shape[2], leaving, ids)

    def _cluster_new_rows(self, new_keys: Tensor) -> tuple[slice | None, Tensor | None]:
        """Index the new rows; rows leaving the local window join their nearest cluster and the pooled sums. →
        (the positions that left, their cluster ids), or (None, None)."""
        pipe = self.pipeline
        self.index = pipe.selector.extend(self.index, new_keys)
        C = self.num_clusters
        assignment = torch.cat([self.pooled.assignment, torch.full(new_keys.shape[:3], C, dtype=torch.long,
                                                                   device=new_keys.device)], dim=2)
        leaving_end = self.num_tokens - pipe.spec.local
        leaving, ids = None, None
        if leaving_end > self.clustered_end:
            leaving = slice(self.clustered_end, leaving_end)
            ids = pipe.clusterer.assign(self.clusters, self.keys[:, :, leaving])
            ids = ids.masked_fill(self.dense_rows[:, None, None], C)
            assignment[:, :, leaving] = ids
            self._pool(ids, self.keys[:, :, leaving], self.values[:, :, leaving])
            self.clustered_end = leaving_end
        self.pooled.assignment = assignment
        self._moments = None
        return leaving, ids

    def _pool(self, ids: Tensor, keys: Tensor, values: Tensor) -> None:
        """Add rows ``[B, Hkv, n, D]`` with cluster ids ``[B, Hkv, n]`` (C: not clustered) to the pooled sums."""
        k, v, pooled = keys.float(), values.float(), self.pooled
        pooled.count = _add_by_cluster(pooled.count, ids, torch.ones_like(k[..., 0]))
        pooled.key_sum = _add_by_cluster(pooled.key_sum, ids, k)
        pooled.value_sum = _add_by_cluster(pooled.value_sum, ids, v)
        pooled.key_square_sum = _add_by_cluster(pooled.key_square_sum, ids, k * k)


MEMBER_ROOM = 64  # slots per cluster for growth in the member table: a check (a device sync) every 64 rows at most


def _wants_members(keys: Tensor) -> bool:
    """Whether the plan lists the clusters' members: for the GPU's per-cluster selection, CUDA caches only."""
    return keys.is_cuda


def _add_by_cluster(total: Tensor, ids: Tensor, rows: Tensor) -> Tensor:
    """total ``[B, H, C(, D)]`` plus ``rows`` ``[B, H, n(, D)]`` summed by cluster id ``[B, H, n]``; id C is dropped."""
    extended = torch.cat([total, torch.zeros_like(total[:, :, :1])], dim=2)
    index = ids if rows.dim() == 3 else ids.unsqueeze(-1).expand_as(rows)
    return extended.scatter_add_(2, index, rows)[:, :, :-1].contiguous()  # kernels read it as is, every step


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
        tail = f"{s.tail}, tail_samples={s.tail_samples:g}" if s.tail == "sample" else s.tail
        return (f"Pipeline({self.clusterer!r}, {self.selector!r}, {self.allocator!r}, {self.kernel!r}, "
                f"tail={tail}, budget={s.budget.model_dump(exclude_none=True)}, sink={s.sink}, local={s.local}, "
                f"gqa={s.gqa})")

    # -- once per request -------------------------------------------------------------------------------------

    def prepare(self, keys: Tensor, values: Tensor, queries: Tensor | None = None, scale: float | None = None,
                mask: Tensor | None = None) -> PipelineState:
        """Cluster the context and build the selector index.

        keys/values ``[B, Hkv, N, D]``; queries ``[B, Hq, M, D]``: prefill queries of this request (QGC's query
        geometry), optional; scale: the logit scale s, default 1/√D; mask ``[B, N]`` bool: False marks padding
        (left padding of a batch), which is never read or clustered.
        """
        _check_cache(keys, values)
        if queries is not None:
            _check_query(queries, keys, "queries")
        scale = _check_scale(scale, keys.shape[-1])
        valid = _check_mask(mask, keys)
        dense_rows = self._dense_rows(valid.sum(-1))
        state = PipelineState(self, keys, values, valid, scale, dense_rows)
        if bool(dense_rows.all()):
            return state

        sink, local = self.spec.sink, self.spec.local
        from_start = valid.cumsum(-1)
        from_end = valid.flip(-1).cumsum(-1).flip(-1)
        clusterable = valid & ~dense_rows[:, None] & (from_start > sink) & (from_end > local)
        generator = torch.Generator().manual_seed(self.spec.seed)  # on the CPU: the same clusters on every device
        clusters = self.clusterer.fit(keys, queries, clusterable, generator)
        self._check_clusters(clusters, clusterable, keys.shape[:3])
        C = clusters.num_clusters
        B, H, n, D = keys.shape
        zeros = keys.new_zeros(B, H, C, D, dtype=torch.float32)
        state.clusters = clusters
        state.pooled = PooledClusters(keys.new_zeros(B, H, C, dtype=torch.float32), zeros, zeros.clone(),
                                      clusters.assignment, zeros.clone())
        state._pool(clusters.assignment, keys, values)
        state.clustered_end = n - local
        state.index = self.selector.build(keys, queries, clusters, torch.Generator().manual_seed(
            _stream(f"selector:{self.spec.seed}")))
        return state

    def _check_clusters(self, clusters: Clusters, clusterable: Tensor, shape: torch.Size) -> None:
        """The clusterer's contract (prepare may wait on the device: it runs once per request)."""
        if not isinstance(clusters, Clusters):
            raise violation(self.clusterer, f"fit must return oa_core.Clusters, got {type(clusters).__name__}")
        a, C = clusters.assignment, clusters.num_clusters
        if not isinstance(a, Tensor) or a.shape != shape or a.dtype != torch.long:
            raise violation(self.clusterer, f"fit must return a long assignment of shape {tuple(shape)}, got "
                                            f"{getattr(a, 'dtype', type(a).__name__)} {tuple(getattr(a, 'shape', ()))}")
        inside = clusterable[:, None, :].expand(shape)
        if not (bool((a[~inside] == C).all()) and bool(((a[inside] >= 0) & (a[inside] < C)).all())):
            raise violation(self.clusterer, f"ids must be in [0, {C}) inside the clusterable region and {C} outside")

    def _check_quotas(self, quotas: Tensor, inputs: AllocationInput, validate: bool) -> Tensor:
        """The allocator's contract: integer quotas ``[B, Hkv, Gs, T, C]``; with ``validate`` (a device sync) also
        0 ≤ q_b ≤ n_b and Σ_b q_b ≤ E_sel."""
        expected = (*inputs.scores.shape[:-1], inputs.counts.shape[-1])
        if not isinstance(quotas, Tensor) or tuple(quotas.shape) != expected or quotas.is_floating_point():
            raise violation(self.allocator, f"allocate must return integer quotas of shape {expected}, got "
                                            f"{getattr(quotas, 'dtype', type(quotas).__name__)} "
                                            f"{tuple(getattr(quotas, 'shape', ()))}")
        if validate and not bool((quotas >= 0).all() & (quotas <= inputs.counts[:, :, None, None]).all()
                                 & (quotas.sum(-1) <= inputs.budget).all()):  # one wait on the device
            raise violation(self.allocator, "quotas must lie in [0, n_b] and add up to at most the budget E_sel")
        return quotas

    def _check_chosen(self, chosen: Tensor, ends: Tensor, assignment: Tensor, most: int, validate: bool) -> None:
        """The selector's contract: integer positions ``[B, Hkv, Gs, T, K]``, each cluster's q_b as one run, clusters
        in order (``ends``: Σ_{c ≤ b} q_c ``[B, Hkv, Gs, T, C]``), then -1; with ``validate`` (a device sync) also
        that layout, and at most ``most`` read."""
        rows = ends.shape[:4]
        if not isinstance(chosen, Tensor) or chosen.shape[:4] != rows or chosen.is_floating_point():
            raise violation(self.selector, f"select must return integer positions of shape {tuple(rows)} + (K,), "
                                           f"got {tuple(getattr(chosen, 'shape', ()))}")
        if not validate:
            return
        too_many = ((chosen >= 0).sum(-1) > most).any()
        column = torch.arange(chosen.shape[-1], device=chosen.device).expand(chosen.shape).contiguous()
        run = torch.searchsorted(ends.contiguous(), column, right=True)  # the cluster whose run holds the column
        B, Hkv = assignment.shape[:2]
        cluster = assignment.gather(-1, chosen.clamp_min(0).reshape(B, Hkv, -1)).reshape(chosen.shape)
        expected = torch.where(run < ends.shape[-1], run, -1)
        in_runs = (torch.where(chosen >= 0, cluster, -1) == expected).all()
        if bool(too_many | ~in_runs):  # one wait on the device for both checks
            if bool(too_many):
                raise violation(self.selector, f"select read more than the {most} rows allowed")
            raise violation(self.selector, "select must list each cluster's q_b positions as one run, clusters in "
                                           "order, then -1 padding")

    def _dense_rows(self, lengths: Tensor) -> Tensor:
        """``[B]`` valid lengths → rows the budget covers (read in full); a clear error for a budget below sink +
        local on the others."""
        budget = self.spec.budget.rows(lengths)
        fixed = self.spec.sink + self.spec.local
        dense = (budget >= lengths) | (lengths <= fixed)
        short = ~dense & (budget < fixed)
        if bool(short.any()):
            row = int(short.nonzero()[0, 0])
            raise SpecError(f"budget: {int(budget[row])} rows ({self.spec.budget.model_dump(exclude_none=True)} of "
                            f"{int(lengths[row])} tokens) is smaller than sink + local = {fixed}")
        return dense

    # -- per decode query -------------------------------------------------------------------------------------

    def attend(self, query: Tensor, state: PipelineState, return_stats: bool = False, causal: bool = False,
               validate: bool = True):
        """query ``[B, Hq, T, D]`` → output ``[B, Hq, T, D]`` (and AttendStats when ``return_stats``).

        Without ``causal`` every one of the T queries sees all N cached rows. With ``causal`` the queries are the
        cache's last T positions (already appended) and query t sees positions up to its own; T must fit the local
        window, so that rows a query must not see are never inside a cluster's proxy. ``validate``: reject a
        query holding NaN/Inf and check the components' outputs against their contracts (quotas within the cluster
        sizes and the budget, reads within the budget): the checks that wait on the device. Turn it off to capture
        attend in a CUDA graph; without it and without stats, attend never waits on the device.
        """
        if not isinstance(state, PipelineState) or state.pipeline is not self:
            raise ValueError("state: pass the PipelineState this pipeline's prepare() returned")
        _check_query(query, state.keys, "query", validate)
        T, n = query.shape[2], state.num_tokens
        if causal and T > max(self.spec.local, 1) and state.clusters is not None:
            raise ValueError(f"query: {T} causal queries do not fit the local window of {self.spec.local}; "
                             "attend them in blocks of at most local tokens")
        plan = state.plan()
        dense = plan.all_dense
        selection = None
        if dense and not causal and not plan.padded:
            out, proxies = self.kernel.attend(query, state.keys, state.values, None, None, state.scale)
        else:
            selection = self._select(query, state, causal, validate)
            proxies_in = state.pooled if self.spec.tail == "proxy" and not dense else None
            out, proxies = self.kernel.attend(query, state.keys, state.values, selection, proxies_in, state.scale)
        if not isinstance(out, Tensor) or out.shape != query.shape or out.dtype != query.dtype:
            raise violation(self.kernel, f"attend must return the query's shape {tuple(query.shape)} and dtype "
                                         f"{query.dtype}, got {getattr(out, 'dtype', type(out).__name__)} "
                                         f"{tuple(getattr(out, 'shape', ()))}")
        if not return_stats:
            return out
        if selection is None:
            reads = torch.full((*state.keys.shape[:2], 1, T), n, device=query.device)
        else:
            reads = selection.valid.sum(-1)
        lengths = plan.lengths  # on the host, as the plan's dense rows: the reason costs no wait on the device
        density = (reads.double() / lengths.to(reads.device).view(-1, 1, 1, 1)).mean()
        stats = AttendStats(density_tensor=density, num_tokens=n, reads=reads, proxies=proxies, dense=dense,
                            reason=self._reason(plan.dense_rows, lengths), kernel=self._kernel_description())
        return out, stats

    def _kernel_description(self) -> str:
        """The kernel, why it was picked, and what it did on the last call (e.g. a fallback and its reason)."""
        note = getattr(self.kernel, "note", "")
        return f"{self.kernel.name} ({self.kernel_note}{'; ' + note if note else ''})"

    def _reason(self, dense_rows: Tensor, lengths: Tensor) -> str:
        budget = self.spec.budget.rows(lengths)
        dense = int(dense_rows.sum())
        if dense == len(lengths):
            if bool((lengths == lengths[0]).all()) and bool((budget == budget[0]).all()):
                return f"dense: budget of {int(budget[0])} rows >= context of {int(lengths[0])} tokens"
            return "dense: every row's budget covers its context"
        suffix = f"; {dense} of {len(lengths)} rows dense (budget >= context)" if dense else ""
        return f"sparse: {self.spec.tail} tail{suffix}"

    def _select(self, query: Tensor, state: PipelineState, causal: bool, validate: bool = False) -> Selection:
        """Steps 4–6 of DESIGN.md §1, plus tail samples: the exact rows of every (query, selection head)."""
        spec = self.spec
        B, Hq, T, _ = query.shape
        Hkv, n = state.keys.shape[1], state.num_tokens
        g = Hq // Hkv
        Gs = 1 if spec.gqa == "shared" else g
        plan = state.plan()
        index = plan.fixed[:, :, None, None, :].expand(B, Hkv, Gs, T, -1)
        runs, drawn = None, None
        if state.clusters is not None:
            sampling = spec.tail == "sample"
            samples = (spec.tail_samples * plan.selectable).round().long() if sampling else 0 * plan.selectable
            scores = self._scores(query, state)
            inputs = self._allocation_inputs(query, state, scores, plan.selectable - samples, plan.max_selectable)
            quotas = self._check_quotas(self.allocator.allocate(inputs), inputs, validate)
            chosen = self.selector.select(scores, inputs.assignment, quotas, width=plan.max_selectable,
                                          members=plan.members)
            ends = quotas.cumsum(-1, dtype=torch.int32)
            self._check_chosen(chosen, ends, inputs.assignment, plan.max_selectable, validate)
            runs = torch.nn.functional.pad(ends, (1, 0)) + index.shape[-1]  # after the fixed rows
            index = torch.cat([index, chosen], dim=-1)
            most = round(spec.tail_samples * plan.max_selectable) if sampling else 0
            if most > 0:
                drawn, log_eta = self._sample_tail(query, scores > -math.inf, index, samples, most, state)
                index = torch.cat([index, drawn], dim=-1)
        # Exact rows weigh 1 (ln 0); tail samples, last, weigh η.
        log_weight = torch.zeros(index.shape, device=query.device)
        if drawn is not None:
            log_weight[..., -drawn.shape[-1]:] = log_eta
        if causal:
            own = torch.arange(n - T, n, device=query.device)[:, None]  # query t sits at position n − T + t
            index = index.masked_fill(index > own, -1)
        return Selection(index, log_weight, runs)

    def _allocation_inputs(self, query: Tensor, state: PipelineState, scores: Tensor, budget: Tensor,
                           width: int | None = None) -> AllocationInput:
        """Step 4: cluster statistics z̄_b = s·q·k̄_b and σ̂_b² = s²Σ_d q_d² Var_b(k_d), with what else allocators see."""
        mean_logit, logit_var = cluster_logit_stats(query, *state.cluster_moments(), state.scale)
        return AllocationInput(mean_logit=mean_logit, logit_var=logit_var, counts=state.pooled.count, scores=scores,
                               assignment=state.pooled.assignment, budget=budget, width=width)

    def _scores(self, query: Tensor, state: PipelineState) -> Tensor:
        """Selector scores ``[B, Hkv, Gs, T, N]``, the max over the group when shared, -inf outside the clusters."""
        outside, shared = state.plan().unclustered, self.spec.gqa == "shared"
        if "outside" in inspect.signature(self.selector.group_scores).parameters:
            return self.selector.group_scores(query, state.index, state.keys, state.scale, shared, outside=outside)
        # A selector written before group_scores took the mask: the pipeline applies it.
        scores = self.selector.group_scores(query, state.index, state.keys, state.scale, shared)
        return scores.masked_fill(outside, -math.inf)

    def _sample_tail(self, query: Tensor, clusterable: Tensor, index: Tensor, samples: Tensor, most: int,
                     state: PipelineState) -> tuple[Tensor, Tensor]:
        """m uniform draws without replacement (``samples`` ``[B, Hkv, 1, 1]``, at most ``most``) from the unread
        clusterable rows of the selector's sampling pool, each weighted ln η_i = ln(|pool|/m) − ln p_i (p_i = 1 for uniform sampling:
        η = N_T/m). → (positions, log weights), both ``[B, Hkv, Gs, T, m]``, -1 padded."""
        n = state.num_tokens
        unread = torch.cat([clusterable, clusterable.new_zeros(*clusterable.shape[:-1], 1)], dim=-1)
        unread.scatter_(-1, index.masked_fill(index < 0, n), False)  # padding goes to the spare column n
        pool = unread[..., :n]
        log_p = self.selector.sample_pool(query, state.index, state.keys, state.scale)
        if log_p is not None:
            log_p = log_p.view(*pool.shape[:2], -1, *pool.shape[3:])  # [B, Hkv, g, T, N]
            pool = pool & (log_p > -math.inf)
        # A stream of its own per (seed, context length): clustering uses `seed` itself, and each decode step
        # resamples.
        generator = torch.Generator(device=index.device).manual_seed(_stream(f"tail-sample:{self.spec.seed}:{n}"))
        noise = torch.rand(pool.shape, generator=generator, device=index.device).masked_fill(~pool, -1.0)
        noise, drawn = noise.topk(min(most, n), dim=-1)
        rank = torch.arange(drawn.shape[-1], device=index.device)
        drawn = drawn.masked_fill((noise < 0) | (rank >= samples[..., None]), -1)
        size = pool.sum(-1, keepdim=True).float()
        taken = (drawn >= 0).sum(-1, keepdim=True).clamp_min(1).float()
        log_eta = torch.log(size / taken).expand(drawn.shape)
        if log_p is not None:
            log_eta = log_eta - log_p.gather(-1, drawn.clamp_min(0))
        return drawn, log_eta.masked_fill(drawn < 0, 0.0)


def _stream(label: str) -> int:
    """A 32-bit seed of its own for each use of the spec's seed (the CPU generator ignores higher seed bits)."""
    return int.from_bytes(hashlib.sha256(label.encode()).digest()[:4], "little")


def _check_mask(mask: Tensor | None, keys: Tensor) -> Tensor:
    B, _, N, _ = keys.shape
    if mask is None:
        return torch.ones(B, N, dtype=torch.bool, device=keys.device)
    if not isinstance(mask, Tensor) or mask.shape != (B, N):
        raise ValueError(f"mask: expected a [B, N] = [{B}, {N}] tensor, got "
                         f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
    if mask.device != keys.device:
        raise ValueError(f"mask: device {mask.device} differs from the cache's {keys.device}")
    mask = mask.bool()
    if not bool(mask.any(-1).all()):
        raise ValueError("mask: every batch row needs at least one valid position")
    return mask


def _check_cache(keys: Tensor, values: Tensor, like: Tensor | None = None, what: str = "",
                 finite: bool = True) -> None:
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
    if finite and not bool(torch.isfinite(keys).all() & torch.isfinite(values).all()):  # one wait on the device
        name = f"{what}keys" if not bool(torch.isfinite(keys).all()) else f"{what}values"
        raise ValueError(f"{name}: the cache contains NaN or Inf")


def _check_query(query: Tensor, keys: Tensor, name: str, check_finite: bool = True) -> None:
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
    if check_finite and not bool(torch.isfinite(query).all()):
        raise ValueError(f"{name}: contains NaN or Inf")


def _check_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    return float(scale)
