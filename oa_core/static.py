"""The fast decode path's state: one layer's pipeline state in buffers of a fixed capacity, grown and attended one
token at a time on the device, with nothing computed on the host (docs/design.md §2).

``StaticState.from_state`` turns a prepared ``PipelineState`` (the prefill's) into preallocated buffers: the cluster
of every cache slot, the pooled sums, the clusters' member lists (room for every token still to come), and the
selector's per-token codes (``Selector.token_codes``). ``StaticState.step`` then does one decode step for a cache
whose new row is already written: the new row gets its codes, the row leaving the local window joins its nearest
cluster (assignment, pooled sums, member list), and the query attends — selector scores over every slot, cluster
statistics, the allocator's quotas, each cluster's best rows, the kernel. Every shape is fixed by the capacity and
every index comes from the ``length`` tensor, so the step can be captured in a CUDA graph; its rows and output are the
reference pipeline's (``tests/test_static.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from oa_core.components import AllocationInput, Clusters, PooledClusters, Selection, Selector, group_queries
from oa_core.ops import triton_path
from oa_core.ops.cluster_stats import cluster_logit_stats_from_sums
from oa_core.ops.selection import cluster_members, select
from oa_core.ops.triton_path import tl, triton
from oa_core.spec import BUDGET_COVERS
from oa_core.state import PipelineState


class StaticUnsupported(ValueError):
    """A state the fast path cannot hold; the message says why (the caller falls back to the eager path)."""


def unsupported(pipeline) -> str | None:
    """Why a pipeline cannot decode on the fast path, whatever the prompt (None: it can)."""
    if pipeline.spec.tail == "sample":
        return "tail: sample draws a new sample at every step"
    if type(pipeline.selector).token_codes is Selector.token_codes:
        return f"selector {pipeline.selector.name!r} has no per-token codes (Selector.token_codes)"
    return None


@dataclass
class StaticState:
    """One layer's state at a fixed capacity (keys and values live in the cache beside it, ``[B, Hkv, capacity, D]``).

    ``length``: 0-d long, the rows written (the new token's included, during a step); ``start`` ``[B]``: each row's
    first valid slot (left padding); ``assignment`` ``[B, Hkv, capacity]``: every slot's cluster, C for the sink, the
    local window, padding and unwritten slots — so the clustered slots are the range [start + sink, length − 1 −
    local] (the prefill's clusterable region, grown by one row a step), which the fused kernels test instead of
    reading ``assignment`` per slot; ``pooled``: the pooled sums; ``members`` ``[B, Hkv, C, S]`` and
    ``member_counts`` ``[B, Hkv, C]``: the clusters' slots (S: the largest cluster at prefill plus every token still to
    come); ``index``: the selector's index with its per-token tensors at capacity."""

    pipeline: Any
    capacity: int
    scale: float
    length: Tensor
    start: Tensor
    clusters: Clusters
    assignment: Tensor
    pooled: PooledClusters
    members: Tensor
    member_counts: Tensor
    index: Any
    token_fields: tuple[str, ...]
    fixed_base: Tensor  # [B, sink + local]: the fixed rows at length 0 (``fixed_rows``)
    fixed_moves: Tensor  # [sink + local]: 1 where a fixed row moves with the length (the window)
    arena: Tensor  # every tensor a step writes, but ``length``, as views into this one byte buffer (``pack``)
    layout: dict  # name → (byte offset, dtype, shape) of each view in ``arena``
    key: int | None = None  # the static cache's registration of this state for its custom op
    fused: Any = None  # the kernel's fused step for this state (``Kernel.static_step``), None: composed

    @classmethod
    def from_state(cls, state: PipelineState, capacity: int, length: Tensor | None = None) -> StaticState:
        """The prefill's prepared state at ``capacity`` slots (≥ its length). ``length``: the cache's own 0-d count of
        rows written, which the cache advances (a tensor of the state's own when None). Raises StaticUnsupported
        where the fast path does not apply: every batch row must be sparse, the tail a proxy or discarded, and the
        selector must say how to index one token in place (``Selector.token_codes``)."""
        pipe, n = state.pipeline, state.num_tokens
        if capacity < n:
            raise ValueError(f"capacity: {capacity} slots cannot hold the {n} tokens already cached")
        if state.clusters is None or bool(state.dense_rows.any()):
            if state.dense_reason == BUDGET_COVERS:
                raise StaticUnsupported("a batch row's budget covers its context (it is read in full)")
            raise StaticUnsupported(f"a batch row is read in full: {state.dense_reason}")
        why = unsupported(pipe)
        if why:
            raise StaticUnsupported(why)
        sample = pipe.selector.token_codes(state.index, state.keys[:, :, :1])
        if sample is None:
            raise StaticUnsupported(f"selector {pipe.selector.name!r} has no per-token codes (Selector.token_codes)")
        B, H, _, D = state.keys.shape
        C, device = state.num_clusters, state.keys.device
        grow = capacity - n

        def at_capacity(tensor: Tensor, fill) -> Tensor:
            shape = (*tensor.shape[:2], capacity, *tensor.shape[3:])
            out = torch.full(shape, fill, dtype=tensor.dtype, device=device)
            out[:, :, :n] = tensor
            return out

        pooled = state.cluster_sums
        assert pooled.key_square_sum is not None  # a prepared state pools the squares too
        members, counts = cluster_members(pooled.assignment, C, room=grow)
        start = (~state.valid).sum(-1)  # left padding: the first valid slot
        arena, layout = pack(
            {
                "start": start,
                "assignment": at_capacity(pooled.assignment, C),
                "count": pooled.count,
                "key_sum": pooled.key_sum,
                "value_sum": pooled.value_sum,
                "key_square_sum": pooled.key_square_sum,
                "members": members,
                "member_counts": counts,
                **{name: at_capacity(getattr(state.index, name), 0) for name in sample},
            }
        )
        views = unpack(arena, layout)
        # Made here, not in a step: a compiled step's CUDA graph may allocate nothing that outlives it.
        spec = pipe.spec
        fixed_base = torch.cat(
            [
                start[:, None] + torch.arange(spec.sink, device=device),
                (torch.arange(spec.local, device=device) - spec.local).expand(B, -1),
            ],
            dim=-1,
        )
        fixed_moves = torch.cat(
            [
                torch.zeros(spec.sink, dtype=torch.long, device=device),
                torch.ones(spec.local, dtype=torch.long, device=device),
            ]
        )
        static = cls(
            pipeline=pipe,
            capacity=capacity,
            scale=state.scale,
            length=torch.tensor(n, device=device) if length is None else length,
            token_fields=tuple(sample),
            fixed_base=fixed_base,
            fixed_moves=fixed_moves,
            arena=arena,
            layout=layout,
            **_fields(state.clusters, state.index, tuple(sample), views),
        )
        static.fused = pipe.kernel.static_step(static)
        return static

    @property
    def num_clusters(self) -> int:
        return self.clusters.num_clusters

    def buffers(self) -> list[Tensor]:
        """The tensors a step reads and writes: ``length`` and the arena (``with_buffers`` takes them back). A compiled
        step passes them to its custom op and marks them static (fixed addresses for CUDA graphs); two tensors, not a
        dozen, because every tensor a compiled graph takes costs the host its guards and checks at every step."""
        return [self.length, self.arena]

    def with_buffers(self, buffers: list[Tensor]) -> StaticState:
        """This state over other tensors of the same layout (``buffers``' order): a compiled op receives its
        arguments as copies that it must write, not the state's own tensors."""
        length, arena = buffers
        if length is self.length and arena is self.arena:
            return self
        return dataclasses.replace(
            self,
            length=length,
            arena=arena,
            **_fields(self.clusters, self.index, self.token_fields, unpack(arena, self.layout)),
        )

    # -- one decode step --------------------------------------------------------------------------------------------

    def step(self, query: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """The new row (slot ``length`` − 1 of ``keys``/``values`` ``[B, Hkv, capacity, D]``, already written) joins
        the state, then ``query`` ``[B, Hq, 1, D]`` attends → ``[B, Hq, 1, D]``: in the kernel's fused step where it
        has one (``Kernel.static_step``), else ``grow`` then ``attend``, each component in turn."""
        if self.fused is not None:
            self.check_cache(keys, values)
            return self.fused(self, query, keys, values)
        self.grow(keys, values)  # checks the cache
        return self.attend(query, keys, values)

    def check_cache(self, keys: Tensor, values: Tensor) -> None:
        """A ValueError unless ``keys`` and ``values`` are the cache this state was made for: contiguous ``[B, Hkv,
        capacity, ·]`` (the kernels address a slot as (batch row · head) · capacity + slot)."""
        want = tuple(self.assignment.shape)
        for name, tensor in (("keys", keys), ("values", values)):
            if tuple(tensor.shape[:3]) != want or not tensor.is_contiguous():
                raise ValueError(
                    f"{name}: a contiguous cache of [B, Hkv, capacity, D] = [{', '.join(map(str, want))}, D] rows, "
                    f"not {tuple(tensor.shape)}{'' if tensor.is_contiguous() else ' (not contiguous)'}"
                )

    def grow(self, keys: Tensor, values: Tensor) -> None:
        """Index the new row; the row leaving the local window joins its nearest cluster (docs/design.md §1)."""
        self.check_cache(keys, values)
        pipe, C = self.pipeline, self.num_clusters
        B, H, _, D = keys.shape
        newest = (self.length - 1).view(1)
        for name, codes in pipe.selector.token_codes(self.index, keys.index_select(2, newest)).items():
            getattr(self.index, name).index_copy_(2, newest, codes)
        leaving = newest - pipe.spec.local
        row = keys.index_select(2, leaving)
        ids = pipe.clusterer.assign(self.clusters, row)  # [B, Hkv, 1]
        if triton_path.unavailable_reason(keys.device) is None:
            _join[(B * H,)](
                ids,
                keys,
                values,
                leaving,
                self.assignment,
                self.pooled.count,
                self.pooled.key_sum,
                self.pooled.value_sum,
                self.pooled.key_square_sum,
                self.members,
                self.member_counts,
                self.capacity,
                C,
                self.members.shape[-1],
                D,
                BLOCK_D=triton.next_power_of_2(D),
            )
            return
        self.assignment.scatter_(2, leaving.expand(B, H, 1), ids)
        k = row.float()
        self.pooled.count.scatter_add_(2, ids, torch.ones_like(k[..., 0]))
        slots = ids[..., None].expand(B, H, 1, D)
        self.pooled.key_sum.scatter_add_(2, slots, k)
        self.pooled.value_sum.scatter_add_(2, slots, values.index_select(2, leaving).float())
        assert self.pooled.key_square_sum is not None  # from_state's pooled sums include the squares
        self.pooled.key_square_sum.scatter_add_(2, slots, k * k)
        S = self.members.shape[-1]
        slot = ids * S + self.member_counts.gather(2, ids)
        self.members.view(B, H, C * S).scatter_(2, slot, leaving.to(self.members.dtype).expand(B, H, 1))
        self.member_counts.scatter_add_(2, ids, torch.ones_like(ids))

    def attend(self, query: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """Steps 4–7 of docs/design.md §1 for one decode query per row."""
        selection = self.selection(query, keys)
        proxies = self.pipeline.tail_proxies(self.pooled, self.assignment)
        out, _ = self.pipeline.kernel.attend(query, keys, values, selection, proxies, self.scale)
        return out

    def selection(self, query: Tensor, keys: Tensor) -> Selection:
        """Steps 4–6: the rows ``query`` ``[B, Hq, 1, D]`` reads — sink, local window, then each cluster's q_b best
        as one run (``Selection.runs``), -1 padded to the width at capacity."""
        pipe, spec, C = self.pipeline, self.pipeline.spec, self.num_clusters
        B, Hq, T, D = query.shape
        H = keys.shape[1]
        grouped = group_queries(query, H, spec.gqa == "shared")
        scores = pipe.selector.score(grouped, self.index, keys, self.scale)
        fixed = self.fixed_rows()
        budget = spec.budget.rows(self.length - self.start) - fixed.shape[-1]  # [B]: E_sel of each row
        budget = budget.clamp_min(0).view(B, 1, 1, 1).expand(B, H, 1, 1)
        width = self.width()
        refines = pipe.selector.refines
        if pipe.allocator.reads_scores or refines:  # else the selection reads each cluster's own scores only
            scores = scores.masked_fill((self.assignment == C)[:, :, None, None, :], -math.inf)
        if refines:
            scores = pipe.selector.refine(scores, grouped, self.index, keys, self.scale, budget, width)
        assert self.pooled.key_square_sum is not None
        mean_logit, logit_var = cluster_logit_stats_from_sums(
            query, self.pooled.count, self.pooled.key_sum, self.pooled.key_square_sum, self.scale
        )
        allocation = AllocationInput(
            mean_logit=mean_logit,
            logit_var=logit_var,
            counts=self.pooled.count,
            scores=scores,
            assignment=self.assignment,
            budget=budget,
            width=width,
        )
        quotas = pipe.allocator.allocate(allocation)
        chosen = select(scores, self.assignment, quotas, width, (self.members, self.member_counts))
        index = torch.cat([fixed[:, None, None, None, :].expand(B, H, *chosen.shape[2:4], -1), chosen], dim=-1)
        runs = torch.nn.functional.pad(quotas.cumsum(-1, dtype=torch.int32), (1, 0)) + fixed.shape[-1]
        return Selection(index, torch.zeros(index.shape, device=query.device), runs)

    def fixed_rows(self) -> Tensor:
        """``[B, sink + local]``: each row's sink (from its first valid slot) and the local window, in order: the
        sink's slots stay, the window's move with ``length``."""
        return self.fixed_base + self.length * self.fixed_moves

    def width(self) -> int:
        """The most rows a step may select: E_sel at capacity (a host number fixed by the spec and the capacity)."""
        spec = self.pipeline.spec
        return max(spec.budget.rows(self.capacity) - spec.sink - spec.local, 0)


ALIGN = 256  # bytes: where each of the arena's tensors starts (a multiple of every dtype's size and of vector loads)


def pack(tensors: dict[str, Tensor]) -> tuple[Tensor, dict]:
    """``tensors`` (one device) copied into one new byte buffer → (the arena, the layout ``unpack`` reads)."""
    layout, end = {}, 0
    for name, tensor in tensors.items():
        layout[name] = (end, tensor.dtype, tuple(tensor.shape))
        end += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    arena = torch.empty(end, dtype=torch.uint8, device=next(iter(tensors.values())).device)
    for name, view in unpack(arena, layout).items():
        view.copy_(tensors[name])
    return arena, layout


def unpack(arena: Tensor, layout: dict) -> dict[str, Tensor]:
    """The arena's tensors, as views (name → tensor of the layout's dtype and shape)."""
    return {
        name: arena[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for name, (offset, dtype, shape) in layout.items()
    }


def _fields(clusters: Clusters, index, token_fields: tuple[str, ...], views: dict[str, Tensor]) -> dict[str, Any]:
    """``StaticState``'s fields over the arena's ``views``. The clusters keep their space and count with the arena's
    assignment: the prepare's own copy (int64, 1.6% of a layer's K and V) would only stay beside it
    (``benchmarks/studies/state_memory.py``)."""
    return dict(
        clusters=dataclasses.replace(clusters, assignment=views["assignment"]),
        start=views["start"],
        assignment=views["assignment"],
        pooled=PooledClusters(
            views["count"], views["key_sum"], views["value_sum"], views["assignment"], views["key_square_sum"]
        ),
        members=views["members"],
        member_counts=views["member_counts"],
        index=dataclasses.replace(index, **{name: views[name] for name in token_fields}) if token_fields else index,
    )


if triton is not None:

    @triton.jit
    def _join(
        IDS,
        K,
        V,
        LEAVING,
        ASSIGNMENT,
        COUNT,
        KSUM,
        VSUM,
        KSQ,
        MEMBERS,
        MEMBER_COUNT,
        CAP,
        C,
        S,
        D,
        BLOCK_D: tl.constexpr,
    ):
        """Program (batch row · KV head): the row leaving the local window joins cluster ``ids`` — its slot's
        assignment, the pooled count, Σk, Σv, Σk⊙k, and the end of the cluster's member list — in one launch (one
        row per head and step: no two programs touch the same cluster)."""
        head = tl.program_id(0).to(tl.int64)
        leaving = tl.load(LEAVING).to(tl.int64)
        c = tl.load(IDS + head).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        ok = offs < D
        row = (head * CAP + leaving) * D + offs
        k = tl.load(K + row, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(V + row, mask=ok, other=0.0).to(tl.float32)
        join_row(
            head, leaving, c, k, v, ASSIGNMENT, COUNT, KSUM, VSUM, KSQ, MEMBERS, MEMBER_COUNT, CAP, C, S, D, offs, ok
        )

    @triton.jit
    def join_row(
        head, leaving, c, k, v, ASSIGNMENT, COUNT, KSUM, VSUM, KSQ, MEMBERS, MEMBER_COUNT, CAP, C, S, D, offs, ok
    ):
        """Slot ``leaving`` of (batch row, KV head) ``head``, key ``k`` and value ``v`` (float32 ``[BLOCK_D]``, lanes
        ``offs``/``ok``), joins cluster ``c``: its assignment, the pooled count, Σk, Σv, Σk⊙k, and the end of the
        cluster's member list (shared with the fused step)."""
        cluster = head * C + c
        tl.store(COUNT + cluster, tl.load(COUNT + cluster) + 1.0)
        sums = cluster * D + offs
        tl.store(KSUM + sums, tl.load(KSUM + sums, mask=ok) + k, mask=ok)
        tl.store(KSQ + sums, tl.load(KSQ + sums, mask=ok) + k * k, mask=ok)
        join_rest(head, leaving, c, v, ASSIGNMENT, VSUM, MEMBERS, MEMBER_COUNT, CAP, C, S, D, offs, ok)

    @triton.jit
    def join_rest(head, leaving, c, v, ASSIGNMENT, VSUM, MEMBERS, MEMBER_COUNT, CAP, C, S, D, offs, ok):
        """``join_row`` less the count, Σk and Σk⊙k (the fused step adds those where it reads them): the slot's
        assignment, Σv, and the end of the cluster's member list."""
        tl.store(ASSIGNMENT + head * CAP + leaving, c)
        cluster = head * C + c
        sums = cluster * D + offs
        tl.store(VSUM + sums, tl.load(VSUM + sums, mask=ok) + v, mask=ok)
        slot = tl.load(MEMBER_COUNT + cluster)
        tl.store(MEMBERS + cluster * S + slot, leaving.to(tl.int32))
        tl.store(MEMBER_COUNT + cluster, slot + 1)
