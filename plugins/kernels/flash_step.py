"""The fast decode path's whole step in seven launches, for QGC's clusters, QGS's codes, ErrorGate's allocation and
flash's kernels (docs/design.md §2). QGS was the default selector until PQS; the one-program step for PQS is issue 56's.

``StaticState.step`` composes the components' own steps, about fifty launches a layer: most are a few microseconds
of glue (casts, index arithmetic, cumulative sums, the new row's codes in torch), and at decode shapes that glue is
most of the step. Where the pipeline is made of the components below, ``FlashKernel.static_step`` takes the step:

1. ``_project``, a program per (batch row, KV head): the new row's QGS codes and the query heads projected on the
   QGS basis;
2. QGS's score kernel over the codes (``group_int8_scores``);
3. ``_grow``, a program per (batch row, KV head, chunk of 16 clusters): the row leaving the local window placed in
   its nearest QGC centroid and joined to it (its slot's cluster, the pooled sums, the member list) by the chunk that
   holds it, and the chunk's logit statistics from the pooled sums (``cluster_stats``' arithmetic);
4. ``_plan``, a program per selection row: ErrorGate's priority and water-filling (``row_log_priority``,
   ``water_fill_row``: the allocator's own Triton functions), then the row's index laid out — sink and local window,
   each cluster's run, -1 padding — with the runs flash reads;
5. the per-cluster selection into the runs (``launch_select``, one launch per size class of clusters: one or two at
   the benchmarks' shapes, three once a cluster may pass 4096 rows); 6–7. flash's pass and merge.

With QGS's ``rerank`` (and ErrorGate's ``floor``, at most the rerank) eight more launches follow the scores
(``two_stage``: the shortlist by a radix select, its exact logits, the floor and the re-ranked scores), and the plan
waits for the floor.

The scores read nothing that the growth and the plan write, nor they anything the scores write (a row joins a
cluster after its codes are written, in an earlier step or by ``_project`` in the same one), so in a CUDA graph's
capture ``_grow`` and ``_plan`` run on a second stream (of high priority) beside the scores, and the selection waits
for both: the graph holds two branches. Launched eagerly, the step keeps to one stream.

The statistics are computed where the join is, a program per chunk of clusters: inside ``_plan``, one program per
row, they took 32–43 µs against 6 µs for a launch of their own (at 16 × 16K on an H200), the head's moments being
too large a tile for one program; beside the join they save that launch and a re-read of the sums.

Same arithmetic as the composed step, so the same rows and output (``tests/test_flash_step.py``): the codes are
rounded half to even as ``torch.round`` does, divisions are IEEE (``div_rn``). Sums run in another order than
cuBLAS's on a GPU, so a key within float rounding of two centroids, or a code of a .5 boundary, may go the other way
there (the composed step's own GPU and CPU paths differ the same way); the device benchmark checks the rows.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from oa_core.components import Selection
from oa_core.ops import triton_path
from oa_core.ops.cluster_stats import BLOCK_C as STATS_CLUSTERS
from oa_core.ops.selection import launch_select, smallest_block
from oa_core.ops.triton_path import libdevice, tl, triton
from oa_core.ops.water_filling import MAX_TRITON_CLUSTERS, launch_config
from oa_plugins.allocators.errorgate import quiet_interpreter
from oa_plugins.kernels.two_stage import TwoStage
from oa_plugins.selectors.qgs import group_int8_scores

if triton is not None:
    from oa_core.ops.cluster_stats import moments_tile, store_logit_stats
    from oa_core.ops.water_filling import water_fill_row
    from oa_core.static import join_rest
    from oa_plugins.allocators.errorgate import row_log_priority
    from oa_plugins.kernels.two_stage import row_budget


def fused_unsupported(state) -> str | None:
    """Why ``FusedStep`` cannot run this ``StaticState``'s step (None: it can)."""
    from oa_plugins.allocators.errorgate import ErrorGate
    from oa_plugins.clusterers.qgc import QueryGeometryClusterer
    from oa_plugins.selectors.qgs import QuerySubspaceSelector

    pipeline = state.pipeline
    reason = triton_path.unavailable_reason(state.length.device)
    if reason is not None:
        return reason
    # Exact types: a subclass may change the arithmetic (assign, token_codes, score) that the kernels repeat.
    if type(pipeline.clusterer) is not QueryGeometryClusterer:
        return f"clusterer {pipeline.clusterer.name!r} (fused: qgc)"
    if type(pipeline.selector) is not QuerySubspaceSelector:
        return f"selector {pipeline.selector.name!r} (fused: qgs)"
    if type(pipeline.allocator) is not ErrorGate:
        return f"allocator {pipeline.allocator.name!r} (fused: errorgate)"
    rerank, floor = pipeline.selector.config.rerank, pipeline.allocator.config.floor
    if floor > rerank:  # the floor's rows must be the shortlist's best (with no shortlist: none)
        return f"errorgate floor: {floor:g} above qgs rerank: {rerank:g} (fused: floor ≤ rerank)"
    if pipeline.spec.tail not in ("proxy", "discard"):
        return f"tail: {pipeline.spec.tail}"
    if state.num_clusters > MAX_TRITON_CLUSTERS:
        return f"{state.num_clusters} clusters (fused: at most {MAX_TRITON_CLUSTERS})"
    if state.scale <= 0:
        return "a non-positive attention scale"
    if pipeline.spec.sink + pipeline.spec.local + state.width() == 0:
        return "nothing to read"
    return None


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of the fused steps on ``device``, of high priority (one for all layers: their steps
    run one after another)."""
    return torch.cuda.Stream(device, priority=-1)


class FusedStep:
    """One layer's fused step (``StaticState.fused``); made once per prepared state, it holds the step's constant
    tensors: the budget's density, the QGS basis and QGC's space (nothing is allocated lazily: a step may run inside
    a CUDA graph's capture)."""

    def __init__(self, state) -> None:
        spec = state.pipeline.spec
        self.fixed = spec.sink + spec.local
        self.width = self.fixed + state.width()
        self.density = torch.tensor(spec.budget.density if spec.budget.density is not None else 0.0,
                                    dtype=torch.float64, device=state.length.device)
        self.tokens = spec.budget.tokens if spec.budget.tokens is not None else -1
        self.shared = spec.gqa == "shared"
        # Constant through decoding, read by every step's _grow: row-major copies.
        projection, centroids = state.clusters.space
        self.basis, self.projection, self.centroids = (t.float().contiguous()
                                                        for t in (state.index.basis, projection, centroids))
        # The selection's smallest block, from the clusters' mean size at the prefill (one read, here: not in a step).
        self.select_block = smallest_block(float(state.member_counts.float().mean()))
        self.side = side_stream(state.length.device) if state.length.device.type == "cuda" else None
        rerank, floor = state.pipeline.selector.config.rerank, state.pipeline.allocator.config.floor
        self.two_stage = TwoStage(rerank, floor, state.width(), state.capacity, state.length.device) \
            if rerank > 0 else None

    def __call__(self, state, query: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        return self.run(state, query, keys, values)[0]

    def run(self, state, query: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Selection]:
        """The step for ``query`` ``[B, Hq, 1, D]`` over the cache ``keys``/``values`` ``[B, Hkv, capacity, D]`` (the
        new row written) → (output ``[B, Hq, 1, D]``, the selection it read)."""
        pipe = state.pipeline
        if query.shape[2] != 1:
            raise ValueError(f"fused static step: one decode query per row, got {query.shape[2]}")
        if not (state.index.codes.is_contiguous() and state.index.scales.is_contiguous()):
            raise ValueError("fused static step: the codes and scales must be contiguous (the kernels' layout)")
        if query.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
            query, keys, values = query.contiguous(), keys.contiguous(), values.contiguous()  # the kernels' layout
        B, Hq, _, D = query.shape
        H, cap = keys.shape[1], keys.shape[2]
        C = state.num_clusters
        g = Hq // H
        Gs, G = (1, g) if self.shared else (g, 1)
        rows = B * H * Gs
        index = state.index
        r, rc = self.basis.shape[-1], self.projection.shape[-1]
        device = query.device
        projected = torch.empty(B, H, g, r, dtype=torch.float32, device=device)
        _project[(B * H,)](keys, query, state.length, self.basis, index.codes, index.scales, projected,
                           *keys.stride()[:3], query.stride(0), query.stride(1), H, cap, G=g, D=D,
                           BLOCK_D=triton.next_power_of_2(D), R=r, BLOCK_R=triton.next_power_of_2(r), num_warps=4)
        # The growth and the plan, and QGS's scores, do not read what the other writes: in a CUDA graph the growth
        # and the plan run on a second stream of high priority beside the scores (the graph holds two branches).
        # The scores fill the device with programs; the priority lets the short chain's programs in first. Every
        # tensor the second stream touches is allocated on the first, which waits for it.
        scores = torch.empty(rows, cap, dtype=torch.float32, device=device)
        mean_logit = torch.empty(B, H, g, 1, C, dtype=torch.float32, device=device)
        logit_var = torch.empty_like(mean_logit)
        quotas = torch.empty(rows, C, dtype=torch.long, device=device)
        offsets = torch.empty(rows, C, dtype=torch.long, device=device)
        runs = torch.empty(rows, C + 1, dtype=torch.int32, device=device)
        chosen = torch.empty(rows, self.width, dtype=torch.long, device=device)
        log_weight = torch.empty(rows, self.width, dtype=torch.float32, device=device)  # 0: every row is exact
        floor = self.two_stage is not None and self.two_stage.floor > 0
        first = torch.empty(rows, C, dtype=torch.int32, device=device) if floor else None
        budget_args = (state.length, state.start, self.density, self.fixed, self.tokens)
        # Only where a CUDA graph is captured: launched eagerly the host's launches set the pace, not the device.
        # (``torch.cuda.stream(None)`` keeps the current stream.)
        side = self.side if self.side is not None and torch.cuda.is_current_stream_capturing() else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            _grow[(B * H, triton.cdiv(C, STATS_CLUSTERS))](
                keys, values, query, state.length, self.projection, self.centroids,
                state.assignment, state.pooled.count, state.pooled.key_sum, state.pooled.value_sum,
                state.pooled.key_square_sum, state.members, state.member_counts, mean_logit, logit_var,
                *keys.stride()[:3], *values.stride()[:3], query.stride(0), query.stride(1), H, cap, C,
                state.members.shape[-1], pipe.spec.local, state.scale, G=g, D=D, BLOCK_D=triton.next_power_of_2(D),
                RC=rc, BLOCK_RC=triton.next_power_of_2(rc), BLOCK_C=max(16, triton.next_power_of_2(C)),
                STATS_C=STATS_CLUSTERS, num_warps=4)
            if first is None:
                self._plan(state, mean_logit, logit_var, None, quotas, offsets, runs, chosen, log_weight, H, Gs, G)
        group_int8_scores(projected, index.codes, index.scales, state.scale, 1, G, out=scores)
        if self.two_stage is not None:  # the shortlist and its exact logits
            listing = self.two_stage.shortlist(scores, keys, query, state, budget_args, Gs, G, pipe.spec.local)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
        if self.two_stage is not None:  # the scores re-ranked in place, the floor's rows counted (after the join)
            self.two_stage.refine(scores, state, budget_args, Gs, listing, first)
        if first is not None:  # the plan waits for the floor
            self._plan(state, mean_logit, logit_var, first, quotas, offsets, runs, chosen, log_weight, H, Gs, G)
        launch_select(scores, state.members, state.member_counts, quotas, offsets, chosen, Gs,
                      self.select_block)
        selection = Selection(chosen.view(B, H, Gs, 1, self.width), log_weight.view(B, H, Gs, 1, self.width),
                              runs.view(B, H, Gs, 1, C + 1))
        proxies = pipe.tail_proxies(state.pooled, state.assignment)
        out, _ = pipe.kernel.attend(query, keys, values, selection, proxies, state.scale)
        return out, selection

    def _plan(self, state, mean_logit, logit_var, first, quotas, offsets, runs, chosen, log_weight, H, Gs, G):
        C = state.num_clusters
        block_c, warps = launch_config(C)
        with quiet_interpreter():
            _plan[(quotas.shape[0],)](
                mean_logit, logit_var, state.pooled.count, state.length, state.start, self.density,
                state.fixed_base, state.fixed_moves, first if first is not None else quotas, quotas, offsets, runs,
                chosen, log_weight, H, Gs, C, self.fixed, self.width, self.tokens, G=G,
                BLOCK_G=triton.next_power_of_2(G), BLOCK_C=block_c, BLOCK_F=max(16, triton.next_power_of_2(self.fixed)),
                HAS_FIRST=first is not None, LIBDEVICE=libdevice is not None and not triton_path.interpreting(),
                num_warps=warps)


if triton is not None:

    @triton.jit
    def _round_half_even(x):
        """``torch.round``: to the nearest integer, halves to the even one. From floor(x) and x − floor(x), both
        exact (x + 0.5 is not: 0.5 − 2⁻²⁵ + 0.5 rounds to 1)."""
        r = tl.floor(x)
        f = x - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)

    @triton.jit
    def _project(K, Q, LENGTH, BASIS, CODES, SCALES, QP, sk_b, sk_h, sk_n, sq_b, sq_h, Hkv, CAP, G: tl.constexpr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr):
        """Program (batch row, KV head): the new row's QGS codes (quantize of kᵀU_r: symmetric int8, a scale per
        row) and the G query heads projected on the same basis (U_rᵀq: what QGS scores with)."""
        head = tl.program_id(0).to(tl.int64)
        b = head // Hkv
        h = head % Hkv
        newest = tl.load(LENGTH).to(tl.int64) - 1
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        basis = tl.load(BASIS + (head * D + offs_d[:, None]) * R + offs_r[None, :],
                        mask=d_ok[:, None] & r_ok[None, :], other=0.0)
        k = tl.load(K + b * sk_b + h * sk_h + newest * sk_n + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        projected = tl.sum(k[:, None] * basis, axis=0)
        row_scale = tl.div_rn(tl.maximum(tl.max(tl.abs(projected), axis=0), 1e-12), 127.0)
        codes = _round_half_even(tl.div_rn(projected, row_scale))
        tl.store(CODES + (head * CAP + newest) * R + offs_r, codes.to(tl.int8), mask=r_ok)
        tl.store(SCALES + head * CAP + newest, row_scale)
        for j in tl.static_range(G):
            q = tl.load(Q + b * sq_b + (h * G + j) * sq_h + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            tl.store(QP + (head * G + j) * R + offs_r, tl.sum(q[:, None] * basis, axis=0), mask=r_ok)

    @triton.jit
    def _grow(K, V, Q, LENGTH, PROJ, CENT, ASSIGNMENT, COUNT, KSUM, VSUM, KSQ, MEMBERS, MEMBER_COUNT, MEAN_LOGIT,
              LOGIT_VAR, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sq_b, sq_h, Hkv, CAP, C, S, LOCAL, scale,
              G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, RC: tl.constexpr, BLOCK_RC: tl.constexpr,
              BLOCK_C: tl.constexpr, STATS_C: tl.constexpr):
        """Program (batch row, KV head, chunk of STATS_C clusters): the chunk's clusters after the leaving row's join
        and their logit statistics. It reads no codes, so it runs beside QGS's scores."""
        head = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        b = head // Hkv
        h = head % Hkv
        newest = tl.load(LENGTH).to(tl.int64) - 1
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        # The row leaving the local window: its nearest centroid in QGC's space (‖μ‖² − 2·x·μ, first of equals).
        leaving = newest - LOCAL
        k = tl.load(K + b * sk_b + h * sk_h + leaving * sk_n + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        offs_rc = tl.arange(0, BLOCK_RC)
        rc_ok = offs_rc < RC
        projection = tl.load(PROJ + (head * D + offs_d[:, None]) * RC + offs_rc[None, :],
                             mask=d_ok[:, None] & rc_ok[None, :], other=0.0)
        point = tl.sum(k[:, None] * projection, axis=0)
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        centre = tl.load(CENT + (head * C + offs_c[:, None]) * RC + offs_rc[None, :],
                         mask=c_ok[:, None] & rc_ok[None, :], other=0.0)
        distance = tl.sum(centre * centre, axis=1) - 2 * tl.sum(centre * point[None, :], axis=1)
        distance = tl.where(c_ok, distance, float("inf"))
        c = tl.min(tl.where(distance == tl.min(distance, axis=0), offs_c, C), axis=0).to(tl.int64)
        c = tl.minimum(c, C - 1)  # a NaN key matches no centroid: it must not write past the clusters
        # ... and joins it: the chunk holding c adds the row to its count, Σk and Σk⊙k in registers and stores them
        # from there (no other program reads or writes that cluster's sums), and writes the rest of the join
        # (``join_row``'s arithmetic).
        offs_s = chunk * STATS_C + tl.arange(0, STATS_C)
        s_ok = offs_s < C
        joins = offs_s == c
        tile = (head * C + offs_s[:, None]) * D + offs_d[None, :]
        t_ok = s_ok[:, None] & d_ok[None, :]
        count = tl.load(COUNT + head * C + offs_s, mask=s_ok, other=1.0)
        key_sum = tl.load(KSUM + tile, mask=t_ok, other=0.0)
        key_square_sum = tl.load(KSQ + tile, mask=t_ok, other=0.0)
        count = tl.where(joins, count + 1.0, count)
        key_sum = tl.where(joins[:, None], key_sum + k[None, :], key_sum)
        key_square_sum = tl.where(joins[:, None], key_square_sum + (k * k)[None, :], key_square_sum)
        tl.store(COUNT + head * C + offs_s, count, mask=s_ok & joins)
        tl.store(KSUM + tile, key_sum, mask=t_ok & joins[:, None])
        tl.store(KSQ + tile, key_square_sum, mask=t_ok & joins[:, None])
        if (c >= chunk * STATS_C) & (c < chunk * STATS_C + STATS_C):
            v = tl.load(V + b * sv_b + h * sv_h + leaving * sv_n + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            join_rest(head, leaving, c, v, ASSIGNMENT, VSUM, MEMBERS, MEMBER_COUNT, CAP, C, S, D, offs_d, d_ok)
        # The chunk's z̄_b and σ̂_b² for each of the head's G query heads (``_cluster_stats``' arithmetic).
        mean, var = moments_tile(key_sum, key_square_sum, count)
        for i in tl.static_range(G):
            q = tl.load(Q + b * sq_b + (h * G + i) * sq_h + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            store_logit_stats(mean, var, q, scale, MEAN_LOGIT, LOGIT_VAR, (head * G + i) * C + offs_s, s_ok)

    @triton.jit
    def _plan(MEAN_LOGIT, LOGIT_VAR, COUNT, LENGTH, START, DENSITY, FIXED_BASE, FIXED_MOVES, FIRST, QUOTAS, OFFSETS,
              RUNS, INDEX, LW, Hkv, Gs, C, F, WIDTH, TOKENS, G: tl.constexpr, BLOCK_G: tl.constexpr,
              BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, HAS_FIRST: tl.constexpr, LIBDEVICE: tl.constexpr):
        """Program (batch row, KV head, selection head): the quotas, and the row's index laid out."""
        p = tl.program_id(0).to(tl.int64)
        b = p // (Gs * Hkv)
        h = (p // Gs) % Hkv
        s = p % Gs
        head = b * Hkv + h
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        count = tl.load(COUNT + head * C + offs_c, mask=c_ok, other=0.0)
        # The row's heads' z̄_b and σ̂_b² (``_grow``'s, one launch before, over every head's chunks).
        offs_g = tl.arange(0, BLOCK_G)
        inside = (offs_g[:, None] < G) & c_ok[None, :]
        stats = ((head * (G * Gs) + s * G + offs_g[:, None]) * C + offs_c[None, :])
        mean_logit = tl.load(MEAN_LOGIT + stats, mask=inside, other=0.0)
        logit_var = tl.load(LOGIT_VAR + stats, mask=inside, other=0.0)
        row = row_log_priority(mean_logit, logit_var, count, G, LIBDEVICE)
        length = tl.load(LENGTH).to(tl.int64)
        budget = row_budget(LENGTH, START, DENSITY, b, F, TOKENS)
        if HAS_FIRST:  # ErrorGate's floor: its rows first, the rest water-filled up to what each cluster has left
            first = tl.load(FIRST + p * C + offs_c, mask=c_ok, other=0).to(tl.int64)
            rest = water_fill_row(row.to(tl.float64), (count - first.to(tl.float32)).to(tl.float64),
                                  (budget - tl.sum(first, axis=0)).to(tl.float64), offs_c, c_ok)
            quotas = first + rest
        else:
            quotas = water_fill_row(row.to(tl.float64), count.to(tl.float64), budget.to(tl.float64), offs_c, c_ok)
        ends = F + tl.cumsum(quotas, axis=0)
        tl.store(QUOTAS + p * C + offs_c, quotas, mask=c_ok)
        tl.store(OFFSETS + p * C + offs_c, ends - quotas, mask=c_ok)
        tl.store(RUNS + p * (C + 1) + 1 + offs_c, ends.to(tl.int32), mask=c_ok)
        tl.store(RUNS + p * (C + 1), (p * 0 + F).to(tl.int32))
        # The index: the sink and the local window first (the window's slots move with the length), then the runs
        # (written by the selection), then -1 up to the width; every column's log weight 0 (all are exact rows).
        offs_f = tl.arange(0, BLOCK_F)
        f_ok = offs_f < F
        fixed = tl.load(FIXED_BASE + b * F + offs_f, mask=f_ok, other=0) + length * tl.load(FIXED_MOVES + offs_f,
                                                                                              mask=f_ok, other=0)
        tl.store(INDEX + p * WIDTH + offs_f, fixed, mask=f_ok)
        end = F + tl.sum(quotas, axis=0)
        for start in range(0, WIDTH, BLOCK_F):
            cols = start + offs_f
            tl.store(INDEX + p * WIDTH + cols, tl.full([BLOCK_F], -1, tl.int64), mask=(cols >= end) & (cols < WIDTH))
            tl.store(LW + p * WIDTH + cols, tl.zeros([BLOCK_F], tl.float32), mask=cols < WIDTH)
