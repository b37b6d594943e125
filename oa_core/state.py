"""One layer's per-request state: the cache, its clusters with pooled sums, the selector's index, the read plan
(what every attend reads regardless of the query, known on the host), and decode-time growth.

``Pipeline.prepare`` makes a state; ``Pipeline.attend`` reads it; ``append``/``grow_to`` grow it by new rows, which
join their nearest cluster once they leave the local window (docs/design.md §1, decode-time growth).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from oa_core.components import Clusters, Composition, PooledClusters
from oa_core.contracts import all_finite, check_cache
from oa_core.ops.cluster_stats import moments_from_sums
from oa_core.ops.scatter import compact, pooled_sums, positions
from oa_core.ops.selection import add_members, cluster_members


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

    pipeline: Composition
    keys: Tensor
    values: Tensor
    valid: Tensor
    scale: float
    dense_rows: Tensor
    dense_reason: str = ""  # why, at the prepare: "budget >= context", or a short context's budget (read_in_full)
    query_heads: int | None = None  # Hq of the prefill queries prepare() was given: decode queries must match
    clusters: Clusters | None = None
    pooled: PooledClusters | None = None
    index: Any = None
    _moments: tuple[Tensor, Tensor] | None = field(default=None, repr=False)
    _plan: ReadPlan | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def clustered_end(self) -> int:
        """The rows before this position have left the local window (and joined a cluster, where they are in one)."""
        return self.num_tokens - self.pipeline.spec.local

    @property
    def num_clusters(self) -> int:
        return self.clusters.num_clusters if self.clusters is not None else 0

    @property
    def cluster_sums(self) -> PooledClusters:
        """``pooled``, of a state with clusters (``start_clusters`` sets both; a state read densely has neither)."""
        assert self.pooled is not None, "a state without clusters has no pooled sums"
        return self.pooled

    def exact_rows(self) -> Tensor:
        """``[B, Hkv, N]``: the valid positions read exactly at every step (sink, local window, dense rows)."""
        fixed = self.valid[:, None, :].expand(*self.keys.shape[:3])
        return fixed if self.clusters is None else fixed & (self.cluster_sums.assignment == self.num_clusters)

    def plan(self) -> ReadPlan:
        """What every attend on this cache reads regardless of the query; built once per prepare (and updated by
        each growth), so that an attend itself never waits on the device (and can run inside a CUDA graph)."""
        if self._plan is None:
            fixed = self.exact_rows()
            fixed_counts = fixed.sum(-1).cpu()
            members, largest = None, 0
            if self.clusters is not None:  # select reads each cluster's scores through its members
                members = cluster_members(self.cluster_sums.assignment, self.num_clusters, room=MEMBER_ROOM)
                largest = int(members[1].max()) if members[1].numel() else 0
            self._plan = self._read_plan(
                positions(fixed),
                self.valid.sum(-1).cpu(),
                fixed_counts,
                members,
                largest,
                None
                if self.clusters is None
                else (self.cluster_sums.assignment == self.num_clusters)[:, :, None, None, :],
                self.dense_rows.cpu(),
                not bool(self.valid.all()),
            )
        return self._plan

    def _read_plan(
        self,
        fixed: Tensor,
        lengths: Tensor,
        fixed_counts: Tensor,
        members,
        largest: int,
        unclustered: Tensor | None,
        dense: Tensor,
        padded: bool,
    ) -> ReadPlan:
        """A ReadPlan from its parts; the budget's split follows from the host-side lengths and counts."""
        selectable = torch.zeros_like(fixed_counts)
        if self.clusters is not None:
            selectable = (self.pipeline.spec.budget.rows(lengths)[:, None] - fixed_counts).clamp_min(0)
            selectable = selectable.masked_fill(dense[:, None], 0)
        return ReadPlan(
            fixed=fixed,
            selectable=selectable[:, :, None, None].to(self.keys.device),
            max_selectable=int(selectable.max()) if selectable.numel() else 0,
            padded=padded,
            lengths=lengths,
            fixed_counts=fixed_counts,
            dense_rows=dense,
            unclustered=unclustered,
            members=members,
            largest_bound=largest,
        )

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
                assert ids is not None  # the rows that left come with their clusters (_cluster_new_rows)
                unclustered[..., leaving] = (ids == C)[:, :, None, None, :]
        if members is not None and leaving is not None:
            assert ids is not None
            largest += left
            if largest > members[0].shape[-1]:  # maybe full: the true largest decides (a device sync)
                largest = int(members[1].max()) + left
            if largest > members[0].shape[-1]:
                members = cluster_members(self.cluster_sums.assignment, C, room=MEMBER_ROOM)
                largest = int(members[1].max())
            else:
                members = add_members(*members, ids, torch.arange(leaving.start, leaving.stop, device=device))
        return self._read_plan(
            fixed, plan.lengths + added, fixed_counts, members, largest, unclustered, dense, plan.padded
        )

    def cluster_moments(self) -> tuple[Tensor, Tensor]:
        """Mean key k̄_b and diagonal variance Var_b(k), ``[B, Hkv, C, D]`` each, derived from the pooled sums."""
        if self._moments is None:
            sums = self.cluster_sums
            assert sums.key_square_sum is not None  # start_clusters pools the squares too
            self._moments = moments_from_sums(sums.count, sums.key_sum, sums.key_square_sum)
        return self._moments

    def fork(self) -> PipelineState:
        """A copy that grows independently (``append`` replaces tensors, never writes into shared ones)."""
        pooled = dataclasses.replace(self.pooled) if self.pooled is not None else None
        return dataclasses.replace(self, pooled=pooled)

    def append(self, keys: Tensor, values: Tensor) -> None:
        """Decode-time growth: add ``[B, Hkv, t, D]`` rows; rows leaving the local window join their nearest cluster
        (rows of dense batch rows stay exact). The state keeps the concatenated cache; to follow a cache that grows
        by itself (transformers'), without a second copy, use ``grow_to``."""
        check_cache(keys, values, like=self.keys, what="appended ", empty=True)
        self._grow(torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2))

    def grow_to(self, keys: Tensor, values: Tensor) -> None:
        """Decode-time growth without copying the cache: ``keys``/``values`` ``[B, Hkv, N', D]`` are the whole cache
        after it grew (a cache's own tensors, or views of them), their first N rows the ones this state holds. The
        state reads them in place from then on; only the new rows are checked (shape, dtype, device, NaN/Inf)."""
        n = self.num_tokens
        if not isinstance(keys, Tensor) or not isinstance(values, Tensor) or keys.dim() != 4 or keys.shape[2] < n:
            raise ValueError(
                f"grow_to: expected the grown cache [B, Hkv, N' >= {n}, D], got {tuple(getattr(keys, 'shape', ()))}"
            )
        new_keys, new_values = keys[:, :, n:], values[:, :, n:]
        check_cache(new_keys, new_values, like=self.keys, what="appended ", finite=False, empty=True)
        # The new rows finite and known rows unchanged (a few, spread, the last included), in one wait: grow_to runs
        # at every decode step.
        ok = all_finite(new_keys, new_values)
        known = probe_rows(n)
        if n:
            ok &= (keys[:, :, known] == self.keys[:, :, known]).all()
            ok &= (values[:, :, n - 1] == self.values[:, :, n - 1]).all()
        if not bool(ok):
            check_cache(new_keys, new_values, what="appended ", empty=True)  # raises when the new rows hold NaN/Inf
            raise CacheMismatch(
                f"grow_to: the grown cache's first rows are not this state's (compared at positions "
                f"{', '.join(map(str, known))})"
            )
        self._grow(keys, values)

    def _grow(self, keys: Tensor, values: Tensor) -> None:
        new_keys = keys[:, :, self.num_tokens :]
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
        pipe, clusters, sums = self.pipeline, self.clusters, self.cluster_sums
        assert clusters is not None
        self.index = pipe.selector.extend(self.index, new_keys)
        C = self.num_clusters
        assignment = torch.cat(
            [sums.assignment, torch.full(new_keys.shape[:3], C, dtype=torch.long, device=new_keys.device)], dim=2
        )
        leaving_end = self.clustered_end
        leaving, ids = None, None
        if new_keys.shape[2]:
            leaving = slice(leaving_end - new_keys.shape[2], leaving_end)
            ids = pipe.clusterer.assign(clusters, self.keys[:, :, leaving])
            ids = ids.masked_fill(self.dense_rows[:, None, None], C)
            assignment[:, :, leaving] = ids
            self._pool(ids, self.keys[:, :, leaving], self.values[:, :, leaving])
        sums.assignment = assignment
        self._moments = None
        return leaving, ids

    def _pool(self, ids: Tensor, keys: Tensor, values: Tensor) -> None:
        """Add rows ``[B, Hkv, n, D]`` with cluster ids ``[B, Hkv, n]`` (C: not clustered) to the pooled sums."""
        pooled = self.cluster_sums
        assert pooled.key_square_sum is not None  # start_clusters pools the squares too
        sums = pooled_sums(
            ids,
            keys,
            values,
            self.num_clusters,
            (pooled.count, pooled.key_sum, pooled.value_sum, pooled.key_square_sum),
        )
        # Contiguous: the kernels read the sums as they are, at every step.
        pooled.count, pooled.key_sum, pooled.value_sum, pooled.key_square_sum = (s.contiguous() for s in sums)

    def start_clusters(self, clusters: Clusters, index: Any) -> None:
        """Take the clusters of the region (fit at prepare, on every row but the local window's) and the selector's
        index: the pooled sums of every cluster from its members."""
        B, H, n, D = self.keys.shape
        C = clusters.num_clusters
        zeros = self.keys.new_zeros(B, H, C, D, dtype=torch.float32)
        self.clusters = clusters
        self.pooled = PooledClusters(zeros[..., 0].clone(), zeros, zeros.clone(), clusters.assignment, zeros.clone())
        self._pool(clusters.assignment, self.keys, self.values)
        self.index = index


MEMBER_ROOM = 64  # slots per cluster for growth in the member table: a check (a device sync) every 64 rows at most
