"""build → prepare → attend: the OpenAttention decode estimator (docs/design.md), composed of registered components.

    pipe = oa.build({"budget": {"density": 0.03}})
    state = pipe.prepare(keys, values, queries)     # once per request: cluster, pool sums, build the index
    out, stats = pipe.attend(query, state, return_stats=True)
    state.append(new_keys, new_values)              # decode-time growth (or state.grow_to(cache_keys, cache_values))

``pipe.explain(query, state)`` returns what ``attend`` decides on the way: the selector's scores, what the allocator
saw, its quotas and the rows read. The state and its growth live in ``oa_core.state``; the rules the inputs and the
components keep, in ``oa_core.contracts``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from pydantic import ValidationError
from torch import Tensor

from oa_core import contracts
from oa_core.components import (
    AllocationInput,
    Allocator,
    Clusterer,
    Kernel,
    PooledClusters,
    Selection,
    Selector,
    group_queries,
)
from oa_core.ops.cluster_stats import cluster_logit_stats
from oa_core.ops.selection import select
from oa_core.registry import ComponentInfo, default_registry
from oa_core.spec import BUDGET_COVERS, ComponentSpec, PipelineSpec, SpecError, describe, load_spec
from oa_core.state import PipelineState


def build(spec: PipelineSpec | Mapping | str | Path | None = None) -> Pipeline:
    """A Pipeline from a spec model, a mapping, or a YAML file path. Raises SpecError naming the field."""
    spec = load_spec(spec if spec is not None else {})
    errors = []

    def attempt(make, *args):  # every bad component in one error
        try:
            return make(*args)
        except SpecError as exc:
            errors.append(str(exc))

    clusterer, selector, allocator = (
        attempt(_instantiate, kind, getattr(spec, kind)) for kind in ("clusterer", "selector", "allocator")
    )
    chosen_kernel = attempt(_kernel, spec.kernel)
    if errors:
        raise SpecError("; ".join(errors))
    kernel, kernel_note = chosen_kernel
    if spec.tail == "proxy" and spec.proxy not in type(kernel).proxies:
        raise SpecError(
            f"proxy: kernel {kernel.name!r} computes {' and '.join(type(kernel).proxies)} proxies, not "
            f"{spec.proxy!r}; set proxy: {type(kernel).proxies[0]} or use another kernel"
        )
    if spec.tail == "sample" and spec.gqa == "shared" and type(selector).sample_pool is not Selector.sample_pool:
        raise SpecError(
            f"gqa: tail: sample with selector {selector.name!r} draws a pool per query head; use gqa: per_head"
        )
    return Pipeline(
        spec, clusterer=clusterer, selector=selector, allocator=allocator, kernel=kernel, kernel_note=kernel_note
    )


def _kernel(kernel: ComponentSpec) -> tuple[Kernel, str]:
    """The kernel the spec names, and why. ``auto``: of the registered kernels that run on this machine's device
    (CUDA when there is one), the one of highest priority."""
    if kernel.name != "auto":
        return _instantiate("kernel", kernel), f"kernel {kernel.name!r} requested"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    registry = default_registry()
    skipped: list[str] = []
    for info in sorted(
        (registry.components["kernel"][name] for name in registry.names("kernel")),
        key=lambda info: -_kernel_class(info).priority,
    ):
        why = _kernel_class(info).unavailable(device)
        if why is None:
            reason = "; ".join(skipped) if skipped else f"runs on {device.type}"
            return _instantiate(
                "kernel", ComponentSpec(name=info.name, params=kernel.params)
            ), f"auto: {info.name} ({reason})"
        skipped.append(f"{info.name}: {why}")
    raise SpecError(f"kernel: auto found no registered kernel that runs on {device.type} ({'; '.join(skipped)})")


def _kernel_class(info: ComponentInfo) -> type[Kernel]:
    return cast("type[Kernel]", info.cls)  # the registry files under "kernel" subclasses of Kernel only


def _instantiate(kind: str, component: ComponentSpec):
    info = default_registry().get(kind, component.name)
    if info is None:
        known = ", ".join(default_registry().names(kind)) or "none registered"
        raise SpecError(f"{kind}: unknown {kind} {component.name!r}; known: {known}")
    try:
        config = info.cls.Config.model_validate(component.params)
    except ValidationError as exc:
        raise SpecError(
            f"{describe(exc, prefix=kind)} ({kind} {component.name!r} from package {info.package!r})"
        ) from None
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
class Explanation:
    """What one attend call decides (``Pipeline.explain``). ``selection``: the rows read (sink, local, selected, then
    sampled tail rows with their weights ln η). With clusters, also ``scores`` ``[B, Hkv, Gs, T, N]`` (the
    selector's, -inf outside the clusters), ``allocation`` (what the allocator saw) and ``quotas``
    ``[B, Hkv, Gs, T, C]``; None where every row is read in full."""

    selection: Selection
    scores: Tensor | None = None
    allocation: AllocationInput | None = None
    quotas: Tensor | None = None


class Pipeline:
    """A composed OpenAttention estimator. Build it with ``oa.build(spec)``."""

    def __init__(
        self,
        spec: PipelineSpec,
        clusterer: Clusterer,
        selector: Selector,
        allocator: Allocator,
        kernel: Kernel,
        kernel_note: str = "",
    ) -> None:
        self.spec = spec
        self.clusterer = clusterer
        self.selector = selector
        self.allocator = allocator
        self.kernel = kernel
        self.kernel_note = kernel_note

    def __repr__(self) -> str:
        s = self.spec
        tail = {"sample": f"sample, tail_samples={s.tail_samples:g}", "proxy": f"proxy ({s.proxy})"}.get(s.tail, s.tail)
        return (
            f"Pipeline({self.clusterer!r}, {self.selector!r}, {self.allocator!r}, {self.kernel!r}, "
            f"tail={tail}, budget={s.budget.model_dump(exclude_none=True)}, sink={s.sink}, local={s.local}, "
            f"gqa={s.gqa})"
        )

    def resolved_spec(self) -> dict:
        """The spec as it runs, as a mapping for a record: every component's params in full, its defaults included
        (the spec itself keeps only the params it was given), so that a record still says what ran after a default
        changes. ``auto``'s kernel stays ``auto`` (which one runs depends on the device)."""
        data = self.spec.model_dump(mode="json")
        for kind in ("clusterer", "selector", "allocator"):
            data[kind]["params"] = getattr(self, kind).config.model_dump(mode="json")
        return data

    def scoring_bytes(self, head_dim: int) -> dict:
        """What choosing the rows reads per key of the context, in bytes, where keys and values are bf16 (a dense
        row: 2·D·2 bytes): ``codes``, the selector's codes or bounds (``Selector.scoring_bytes``; None: not stated),
        and ``rerank``, its shortlist's exact keys on average (the re-rank multiple × the density × D·2 bytes; 0 for a
        selector that does not re-rank, or a budget in tokens, whose share depends on the context)."""
        rerank = getattr(self.selector.config, "rerank", 0.0) if self.selector.refines else 0.0
        density = self.spec.budget.density or 0.0
        return {
            "codes": self.selector.scoring_bytes(head_dim),
            "rerank": round(rerank * density * head_dim * 2, 2),
            "dense_row": 2 * head_dim * 2,
        }

    # -- once per request -------------------------------------------------------------------------------------

    def prepare(
        self,
        keys: Tensor,
        values: Tensor,
        queries: Tensor | None = None,
        scale: float | None = None,
        mask: Tensor | None = None,
    ) -> PipelineState:
        """Cluster the context and build the selector index.

        keys/values ``[B, Hkv, N, D]``; queries ``[B, Hq, M, D]``: prefill queries of this request (QGC's query
        geometry), optional; scale: the logit scale s, default 1/√D; mask ``[B, N]`` bool: False marks padding
        (left padding of a batch), which is never read or clustered.
        """
        contracts.check_cache(keys, values)
        if queries is not None:
            contracts.check_query(queries, keys, "queries")
        scale = contracts.check_scale(scale, keys.shape[-1])
        valid = contracts.check_mask(mask, keys)
        lengths = valid.sum(-1)
        dense_rows = self.spec.read_in_full(lengths)
        reasons = [self.spec.why_read_in_full(lengths)] if bool(dense_rows.any()) else []
        few, few_why = self._too_few_to_cluster(lengths, dense_rows)
        if few_why:
            reasons.append(few_why)
            dense_rows = dense_rows | few
        why = "; ".join(reasons)
        state = PipelineState(
            self,
            keys,
            values,
            valid,
            scale,
            dense_rows,
            dense_reason=why,
            query_heads=None if queries is None else queries.shape[1],
        )
        if bool(dense_rows.all()):
            return state
        # The clusterable region: valid rows of sparse batch rows, past the sink and before the local window.
        from_start = valid.cumsum(-1)
        from_end = valid.flip(-1).cumsum(-1).flip(-1)
        clusterable = valid & ~dense_rows[:, None] & (from_start > self.spec.sink) & (from_end > self.spec.local)
        generator = torch.Generator().manual_seed(self.spec.seed)  # on the CPU: the same clusters on every device
        clusters = self.clusterer.fit(keys, queries, clusterable, generator)
        contracts.check_clusters(self.clusterer, clusters, clusterable, keys.shape[1])
        index = self.selector.build(
            keys, queries, clusters, torch.Generator().manual_seed(_stream(f"selector:{self.spec.seed}"))
        )
        state.start_clusters(clusters, index)
        return state

    def _too_few_to_cluster(self, lengths: Tensor, dense_rows: Tensor) -> tuple[Tensor, str]:
        """``[B]`` lengths → (the rows not already ``dense_rows`` with no more keys between the sink and the local
        window than the clusterer's ``num_clusters`` — every key would be its own cluster, the proxies the keys
        themselves —, why in words; "" when none)."""
        wanted = getattr(getattr(self.clusterer, "config", None), "num_clusters", None)
        keys = lengths - self.spec.sink - self.spec.local
        few = (keys <= wanted if wanted is not None else torch.zeros_like(dense_rows)) & ~dense_rows
        if not bool(few.any()):
            return few, ""
        row = int(few.nonzero()[0, 0])
        return few, (
            f"clusterer.num_clusters = {wanted} >= the {max(0, int(keys[row]))} keys between sink and local "
            f"window of a {int(lengths[row])}-token context (each key would be its own cluster)"
        )

    # -- per decode query -------------------------------------------------------------------------------------

    def attend(
        self,
        query: Tensor,
        state: PipelineState,
        return_stats: bool = False,
        causal: bool = False,
        validate: bool = True,
    ):
        """query ``[B, Hq, T, D]`` → output ``[B, Hq, T, D]`` (and AttendStats when ``return_stats``).

        Without ``causal`` every one of the T queries sees all N cached rows. With ``causal`` the queries are the
        cache's last T positions (already appended) and query t sees positions up to its own; T must fit the local
        window, so that rows a query must not see are never inside a cluster's proxy. ``validate``: reject a
        query holding NaN/Inf and check the allocator's quotas against its contract (within the cluster sizes and
        the budget): the checks that wait on the device. Turn it off to capture attend in a CUDA graph; without it
        and without stats, attend never waits on the device.
        """
        self._check(query, state, causal, validate)
        plan = state.plan()
        if plan.all_dense and not causal and not plan.padded:
            selection = None
            out, proxies = self.kernel.attend(query, state.keys, state.values, None, None, state.scale)
        else:
            selection = self._explain(query, state, causal, validate).selection
            out, proxies = self.kernel.attend(
                query, state.keys, state.values, selection, self.tail_proxies(state.pooled), state.scale
            )
        contracts.check_output(self.kernel, out, query)
        return (out, self._stats(query, state, selection, proxies)) if return_stats else out

    def tail_proxies(self, pooled: PooledClusters | None, assignment: Tensor | None = None) -> PooledClusters | None:
        """What the kernel builds the tail's proxies from: the pooled sums (``assignment`` in place of theirs, where
        given) marked with the spec's ``proxy``; None where the tail is not a proxy or nothing is clustered."""
        if self.spec.tail != "proxy" or pooled is None:
            return None
        return PooledClusters(
            pooled.count,
            pooled.key_sum,
            pooled.value_sum,
            pooled.assignment if assignment is None else assignment,
            pooled.key_square_sum,
            second_order=self.spec.proxy == "second-order",
        )

    def explain(self, query: Tensor, state: PipelineState, causal: bool = False, validate: bool = True) -> Explanation:
        """The decisions of ``attend(query, state, causal=causal)`` (docs/design.md, steps 4–6 and tail samples):
        the selector's scores, the allocator's inputs and quotas, and the rows each (query, selection head) reads."""
        self._check(query, state, causal, validate)
        return self._explain(query, state, causal, validate)

    def _explain(self, query: Tensor, state: PipelineState, causal: bool, validate: bool) -> Explanation:
        spec, plan = self.spec, state.plan()
        B, Hq, T, _ = query.shape
        Hkv, n = state.keys.shape[1], state.num_tokens
        grouped = group_queries(query, Hkv, spec.gqa == "shared")
        Gs = grouped.shape[2]
        index = plan.fixed[:, :, None, None, :].expand(B, Hkv, Gs, T, -1)
        if state.clusters is None:
            explanation = Explanation(Selection(index, torch.zeros(index.shape, device=query.device)))
        else:
            sampling = spec.tail == "sample"
            samples = (spec.tail_samples * plan.selectable).round().long() if sampling else None
            scores = self.selector.score(grouped, state.index, state.keys, state.scale)
            contracts.check_scores(self.selector, scores, (B, Hkv, Gs, T, n))
            assert plan.unclustered is not None  # the plan of a state with clusters marks the rows outside them
            scores = scores.masked_fill(plan.unclustered, -math.inf)
            budget = plan.selectable - samples if samples is not None else plan.selectable
            scores = self.selector.refine(
                scores, grouped, state.index, state.keys, state.scale, budget, plan.max_selectable
            )
            mean_logit, logit_var = cluster_logit_stats(query, *state.cluster_moments(), state.scale)
            pooled = state.cluster_sums
            allocation = AllocationInput(
                mean_logit=mean_logit,
                logit_var=logit_var,
                counts=pooled.count,
                scores=scores,
                assignment=pooled.assignment,
                budget=budget,
                width=plan.max_selectable,
            )
            quotas = self.allocator.allocate(allocation)
            contracts.check_quotas(self.allocator, quotas, allocation, values=validate)
            chosen = select(scores, allocation.assignment, quotas, width=plan.max_selectable, members=plan.members)
            runs = torch.nn.functional.pad(quotas.cumsum(-1, dtype=torch.int32), (1, 0)) + index.shape[-1]
            index = torch.cat([index, chosen], dim=-1)
            log_weight = torch.zeros(index.shape, device=query.device)  # exact rows weigh 1 (ln 0)
            most = round(spec.tail_samples * plan.max_selectable) if sampling else 0
            if most > 0:  # tail samples come last, weighted η
                assert samples is not None  # most > 0: sampling
                drawn, log_eta = self._sample_tail(grouped, scores > -math.inf, index, samples, most, state)
                index = torch.cat([index, drawn], dim=-1)
                log_weight = torch.cat([log_weight, log_eta], dim=-1)
            explanation = Explanation(Selection(index, log_weight, runs), scores, allocation, quotas)
        if causal:
            own = torch.arange(n - T, n, device=query.device)[:, None]  # query t sits at position n − T + t
            selection = explanation.selection
            selection.index = selection.index.masked_fill(selection.index > own, -1)
        return explanation

    def _check(self, query: Tensor, state: PipelineState, causal: bool, validate: bool) -> None:
        if not isinstance(state, PipelineState) or state.pipeline is not self:
            raise ValueError("state: pass the PipelineState this pipeline's prepare() returned")
        contracts.check_query(query, state.keys, "query", validate, heads=state.query_heads)
        if causal and query.shape[2] > max(self.spec.local, 1) and state.clusters is not None:
            raise ValueError(
                f"query: {query.shape[2]} causal queries do not fit the local window of "
                f"{self.spec.local}; attend them in blocks of at most local tokens"
            )

    def _sample_tail(
        self, grouped: Tensor, clusterable: Tensor, index: Tensor, samples: Tensor, most: int, state: PipelineState
    ) -> tuple[Tensor, Tensor]:
        """m uniform draws without replacement (``samples`` ``[B, Hkv, 1, 1]``, at most ``most``) from the unread
        clusterable rows of the selector's sampling pool, each weighted ln η_i = ln(|pool|/m) − ln p_i (p_i = 1 for
        uniform sampling: η = N_T/m). → (positions, log weights), both ``[B, Hkv, Gs, T, m]``, -1 padded."""
        n = state.num_tokens
        unread = torch.cat([clusterable, clusterable.new_zeros(*clusterable.shape[:-1], 1)], dim=-1)
        unread.scatter_(-1, index.masked_fill(index < 0, n), False)  # padding goes to the spare column n
        pool = unread[..., :n]
        log_p = self.selector.sample_pool(grouped, state.index, state.keys, state.scale)
        if log_p is not None:
            log_p = log_p.flatten(2, 3)  # [B, Hkv, g, T, N]: a pool is per query head (gqa: per_head)
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

    def _stats(
        self, query: Tensor, state: PipelineState, selection: Selection | None, proxies: Tensor | None
    ) -> AttendStats:
        plan = state.plan()
        T, n = query.shape[2], state.num_tokens
        if selection is None:
            reads = torch.full((*state.keys.shape[:2], 1, T), n, device=query.device)
        else:
            reads = selection.valid.sum(-1)
        lengths = plan.lengths  # on the host, as the plan's dense rows: the reason costs no wait on the device
        density = (reads.double() / lengths.to(reads.device).view(-1, 1, 1, 1)).mean()
        note = getattr(self.kernel, "note", "")
        kernel = f"{self.kernel.name} ({self.kernel_note}{'; ' + note if note else ''})"
        return AttendStats(
            density_tensor=density,
            num_tokens=n,
            reads=reads,
            proxies=proxies,
            dense=plan.all_dense,
            reason=self._reason(plan.dense_rows, lengths, state.dense_reason),
            kernel=kernel,
        )

    def _reason(self, dense_rows: Tensor, lengths: Tensor, why: str) -> str:
        budget = self.spec.budget.rows(lengths)
        dense = int(dense_rows.sum())
        if dense == len(lengths):
            if why != BUDGET_COVERS:
                return f"dense: {why}"
            if bool((lengths == lengths[0]).all()) and bool((budget == budget[0]).all()):
                return f"dense: budget of {int(budget[0])} rows >= context of {int(lengths[0])} tokens"
            return "dense: every row's budget covers its context"
        suffix = f"; {dense} of {len(lengths)} rows dense ({why})" if dense else ""
        return f"sparse: {self.spec.tail} tail{suffix}"


def _stream(label: str) -> int:
    """A 32-bit seed of its own for each use of the spec's seed (the CPU generator ignores higher seed bits)."""
    return int.from_bytes(hashlib.sha256(label.encode()).digest()[:4], "little")
