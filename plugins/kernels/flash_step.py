"""The fast decode path's whole step in a few launches — the default's: six a layer with the CUDA shortlist, seven
with Triton's (``FusedStep.launches``) — for QGC's clusters, QGS's or PQS's codes, ErrorGate's allocation and flash's
kernels (docs/design.md §2).

``StaticState.step`` composes the components' own steps, about fifty launches a layer: most are a few microseconds
of glue (casts, index arithmetic, cumulative sums, the new row's codes in torch), and at decode shapes that glue is
most of the step. Where the pipeline is made of the components below, ``FlashKernel.static_step`` takes the step:

1. ``prologue`` (``FusedStep.prologue``), a grid of (batch row, KV head) × (1 + its chunks of 16 clusters): part 0
   the selector's projection, the new row's codes and the query heads in the codes' terms — QGS: its int8 codes and
   the heads projected on its basis (``_project_row``); PQS, the default: each sub-space's nearest centroid and the
   heads' tables q_m·μ_{m,c} (``_pq_project_row``); the other parts the growth, the row leaving the local window
   placed in its nearest QGC centroid and joined to it (its slot's cluster, the pooled sums, the member list) by the
   chunk that holds it, and each chunk's logit statistics from the pooled sums (``cluster_stats``' arithmetic);
2. the selector's score kernel over the codes (``group_int8_scores``, ``group_lut_scores``);
3. ``plan``, a program per selection row: ErrorGate's priority and water-filling (``row_log_priority``,
   ``water_fill_row``: the allocator's own Triton functions), then the row's index laid out — sink and local window,
   each cluster's run, -1 padding — with the runs flash reads, and the row's counter of flash's parts zeroed;
4. the per-cluster selection into the runs (``launch_select``, one launch per size class of clusters: one or two at
   the benchmarks' shapes, three once a cluster may pass 4096 rows); 5. flash's pass, whose last part of each row
   merges the row (``FlashKernel.sparse``); its proxies take the prologue's statistics (``logit_stats``), not Σk
   and Σk⊙k again.

With the selector's ``rerank`` (and ErrorGate's ``floor``, at most the rerank) the shortlist follows the scores
(``two_stage``: the shortlist by a radix select, its exact logits, the floor, and each row's shift; the listed scores
are boxed and the selection re-ranks as it reads them), and the plan waits for the floor: its program takes the
row's shift and floor first (without a floor, ``refine`` takes the shift, a program per row). QGS's shortlist takes
seven launches after its scores. PQS's — the default's — takes three in all (``TwoStage.pq_shortlist``): its scores
with each row's first radix digit counted, the cut, the listing with the exact logits (the codes read once for the
group's selection rows, each K row once for the rows that list it); the default's step is six launches a layer
and one per size class of clusters in the selection
(``FusedStep.launches``). One program per (batch row, KV head) for the scores and the shortlist (73c848f) took
2.41 ms a layer at 16 × 16K and 16.4 ms at 2 × 128K on an H100, per head at 1% (``benchmarks/kernel_h200.py``),
against 0.99 and 1.35 ms with the three launches: too few programs, each a long chain. On a GPU of sm_90 or later
with nvcc, PQS's scores and shortlist take one CUDA launch instead — a thread-block cluster per (batch row, KV head)
that keeps the scores on chip between the cut's passes — and Triton's ``exact_logits`` a second
(``pq_shortlist_cuda``: the step 1.41–1.59× faster per head on an H100 at fa826a3); ``shortlist_note`` says why not
where not.

Without a floor the scores read nothing that the plan writes, nor it anything the scores write, so in a CUDA graph's
capture the plan runs on a second stream (of high priority) beside the scores, and the selection waits for both: the
graph holds two branches. With a floor (the default's) the plan follows the shortlist. Launched eagerly, the step
keeps to one stream. The growth, in the prologue, is written before the scores read the clusters: the row leaving
the window is inside the shortlist's clusters whether or not its join is written (a row joins a cluster after its
codes are written, in an earlier step or by the projection in the same launch).

The statistics are computed where the join is, a program per chunk of clusters: inside ``plan``, one program per
row, they took 32–43 µs against 6 µs for a launch of their own (at 16 × 16K on an H200), the head's moments being
too large a tile for one program; beside the join they save that launch and a re-read of the sums.

Same arithmetic as the composed step, so the same rows and output (``tests/test_flash_step.py``): the codes are
rounded half to even as ``torch.round`` does, divisions are IEEE (``div_rn``). Sums run in another order than
cuBLAS's on a GPU, so a key within float rounding of two centroids, or a code of a .5 boundary, may go the other way
there (the composed step's own GPU and CPU paths differ the same way); the device benchmark checks the rows.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from oa_core.components import Selection, Selector
from oa_core.ops import triton_path
from oa_core.ops.cluster_stats import BLOCK_C as STATS_CLUSTERS
from oa_core.ops.selection import MAX_BOXED, launch_select, size_classes, smallest_block
from oa_core.ops.triton_path import libdevice, triton
from oa_core.ops.water_filling import MAX_TRITON_CLUSTERS, launch_config
from oa_plugins.allocators.errorgate import quiet_interpreter
from oa_plugins.kernels import pq_shortlist_cuda
from oa_plugins.kernels import two_stage as stages
from oa_plugins.selectors.pq import ProductQuantisedSelector, code_block, group_lut_scores, packed
from oa_plugins.selectors.qgs import QuerySubspaceSelector, group_int8_scores

# The plan's warps (more where launch_config gives more: above 64 clusters). On an H200 the plan alone took 0.022 ms at
# 4 warps against 0.063 at 2, at 8 × 16K shared and 1%; 0.040 against 0.066 at 16 × 16K per head, 0.114 against 0.139
# at 32 × 32K (0.033/0.083, 0.068/0.084, 0.214/0.233 at 3%; 8 warps no faster, or slower per head):
# ``benchmarks/studies/plan_phases.py``, ``plan_phases_h200.json``.
PLAN_WARPS = 4

if triton is not None:
    from oa_plugins.kernels.flash_step_programs import prologue
    from oa_plugins.kernels.plan_programs import plan


def fused_unsupported(state) -> str | None:
    """Why ``FusedStep`` cannot run this ``StaticState``'s step (None: it can)."""
    from oa_plugins.allocators.errorgate import ErrorGate
    from oa_plugins.clusterers.qgc import QueryGeometryClusterer

    pipeline = state.pipeline
    reason = triton_path.unavailable_reason(state.length.device)
    if reason is not None:
        return reason
    # Exact types: a subclass may change the arithmetic (assign, token_codes, score) that the kernels repeat.
    if type(pipeline.clusterer) is not QueryGeometryClusterer:
        return f"clusterer {pipeline.clusterer.name!r} (fused: qgc)"
    if type(pipeline.selector) not in SCORING:
        return f"selector {pipeline.selector.name!r} (fused: {', '.join(s.name for s in SCORING)})"
    if type(pipeline.allocator) is not ErrorGate:
        return f"allocator {pipeline.allocator.name!r} (fused: errorgate)"
    rerank, floor = pipeline.selector.config.rerank, pipeline.allocator.config.floor
    if floor > rerank:  # the floor's rows must be the shortlist's best (with no shortlist: none)
        name = pipeline.selector.name
        return f"errorgate floor: {floor:g} above {name} rerank: {rerank:g} (fused: floor ≤ rerank)"
    longest = min(state.capacity, math.ceil(rerank * state.width()))
    if longest > MAX_BOXED:
        return f"a shortlist of {longest:,} rows (fused: at most {MAX_BOXED:,}, the selection's boxes)"
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


class QGSScoring:
    """QGS's part of the step: the prologue's projection writes the new row's int8 codes and projects the query heads
    on the QGS basis; ``group_int8_scores`` scores every position's codes."""

    # The programs it launches: the projection, the scores; with a re-rank, the scores and the shortlist's seven.
    LAUNCHES = ("prologue", "_group_int8_scores")
    SHORTLIST = ("_group_int8_scores", *["radix_pass"] * 4, "cut_row", "compact", "exact_logits")

    def __init__(self, state) -> None:
        index = state.index
        if not (index.codes.is_contiguous() and index.scales.is_contiguous()):
            raise ValueError("fused static step: the codes and scales must be contiguous (the kernels' layout)")
        self.basis = index.basis.float().contiguous()  # constant through decoding: a row-major copy

    def projection(self, state, query: Tensor, keys: Tensor) -> tuple[Tensor, dict]:
        """The prologue's projection: its output (the heads projected, ``[B, Hkv, g, r]``) and its arguments."""
        B, Hq = query.shape[:2]
        H = keys.shape[1]
        g, r = Hq // H, self.basis.shape[-1]
        projected = torch.empty(B, H, g, r, dtype=torch.float32, device=query.device)
        args = dict(SPACE=self.basis, CODES=state.index.codes, SCALES=state.index.scales, OUT=projected, PQ=False)
        return projected, {**args, "R": r, "BLOCK_R": triton.next_power_of_2(r)}

    def score(self, state, projected: Tensor, scores: Tensor, G: int) -> None:
        group_int8_scores(projected, state.index.codes, state.index.scales, state.scale, 1, G, out=scores)

    def shortlist(self, two_stage, state, projected, scores, keys, query, budget_args, Gs: int, G: int):
        """The scores, then the two-stage shortlist's seven launches."""
        self.score(state, projected, scores, G)
        return two_stage.shortlist(scores, keys, query, state, budget_args, Gs, G, state.pipeline.spec.local)


class PQSScoring:
    """PQS's part of the step: the prologue's projection writes the new row's codes (each sub-space's nearest
    centroid) and the query heads' tables; ``group_lut_scores`` sums every position's table entries."""

    BLOCK_C = 16  # centroids per tile of ``_pq_project_row``
    LAUNCHES = ("prologue", "_group_lut_scores")
    SHORTLIST = ("pq_scores", "pq_cut", "pq_list")  # the scores and the shortlist

    def __init__(self, state) -> None:
        if not state.index.codes.is_contiguous():
            raise ValueError("fused static step: the codes must be contiguous (the kernels' layout)")
        self.centroids = state.index.centroids.float().contiguous()  # [B, Hkv, M, C, dims], constant

    def projection(self, state, query: Tensor, keys: Tensor) -> tuple[Tensor, dict]:
        """The prologue's projection: its output (the heads' tables, ``[B, Hkv, g, M, C]``) and its arguments."""
        B, Hq = query.shape[:2]
        H = keys.shape[1]
        M, C, dims = self.centroids.shape[2:]
        g = Hq // H
        tables = torch.empty(B, H, g, M, C, dtype=torch.float32, device=query.device)
        return tables, dict(
            SPACE=self.centroids,
            CODES=state.index.codes,
            OUT=tables,
            PQ=True,
            M=M,
            CC=C,
            DIMS=dims,
            W=state.index.codes.shape[-1],
            PACKED=packed(C),
            BLOCK_M=code_block(M),
            BLOCK_CC=min(self.BLOCK_C, triton.next_power_of_2(C)),
            BLOCK_DIMS=triton.next_power_of_2(dims),
        )

    def score(self, state, tables: Tensor, scores: Tensor, G: int) -> None:
        B, H = tables.shape[:2]
        group_lut_scores(tables, state.index.codes, state.scale, 1, G, out=scores.view(B, H, -1, scores.shape[-1]))

    def shortlist(self, two_stage, state, tables, scores, keys, query, budget_args, Gs: int, G: int):
        """The scores and the two-stage shortlist in three launches (``TwoStage.pq_shortlist``)."""
        return two_stage.pq_shortlist(tables, state, scores, keys, query, budget_args, Gs, G)


# The selectors the step fuses, by exact type (a subclass may change the arithmetic the kernels repeat).
SCORING: dict[type[Selector], type[QGSScoring | PQSScoring]] = {
    QuerySubspaceSelector: QGSScoring,
    ProductQuantisedSelector: PQSScoring,
}


class FusedStep:
    """One layer's fused step (``StaticState.fused``); made once per prepared state, it holds the step's constant
    tensors: the budget's density, the selector's constants (``scoring``: QGS's basis or PQS's centroids) and QGC's
    space (nothing is allocated lazily: a step may run inside a CUDA graph's capture)."""

    def __init__(self, state) -> None:
        spec = state.pipeline.spec
        self.fixed = spec.sink + spec.local
        self.width = self.fixed + state.width()
        self.density = torch.tensor(
            spec.budget.density if spec.budget.density is not None else 0.0,
            dtype=torch.float64,
            device=state.length.device,
        )
        self.tokens = spec.budget.tokens if spec.budget.tokens is not None else -1
        self.shared = spec.gqa == "shared"
        self.scoring = SCORING[type(state.pipeline.selector)](state)
        # Constant through decoding, read by every step's grow: row-major copies.
        self.projection, self.centroids = (t.float().contiguous() for t in state.clusters.space)
        # The selection's smallest block, from the clusters' mean size at the prefill (one read, here: not in a step).
        self.select_block = smallest_block(float(state.member_counts.float().mean()))
        self.side = side_stream(state.length.device) if state.length.device.type == "cuda" else None
        rerank, floor = state.pipeline.selector.config.rerank, state.pipeline.allocator.config.floor
        self.two_stage = (
            stages.TwoStage(rerank, floor, state.width(), state.capacity, state.length.device) if rerank > 0 else None
        )
        # PQS's scores and shortlist in one CUDA launch where the device takes it (sm_90+, nvcc), else Triton's three:
        # ``shortlist_note`` says why not.
        self.shortlist_note = (
            pq_shortlist_cuda.unavailable_reason(state)
            if self.two_stage is not None and isinstance(self.scoring, PQSScoring)
            else "the CUDA shortlist serves PQS's two-stage selection only"
        )
        self.shortlist_cuda = self.shortlist_note is None

    @property
    def note(self) -> str:
        """What the step is, for the run's records: with PQS's shortlist, whether it is the CUDA launch, or why not."""
        if self.two_stage is None or not isinstance(self.scoring, PQSScoring):
            return "the kernel's fused step"
        how = "in one CUDA launch" if self.shortlist_cuda else f"by Triton ({self.shortlist_note})"
        return f"the kernel's fused step, PQS's shortlist {how}"

    def launches(self, state) -> list[str]:
        """The programs one step launches (Triton's, and the CUDA shortlist where it runs), in the order of the code
        (without a floor the plan may run on a second stream beside the scores): the step's own declaration, which
        ``tests/test_flash_step.py`` checks against the launches a step makes. The selection takes one launch per size
        class of clusters (``size_classes``: from the largest cluster's slots)."""
        classes = len(size_classes(state.members.shape[-1], self.select_block))
        floor = self.two_stage is not None and self.two_stage.floor > 0
        return self.launch_names(type(self.scoring), self.two_stage is not None, floor, classes, self.shortlist_cuda)

    @staticmethod
    def launch_names(
        scoring: type[QGSScoring | PQSScoring], rerank: bool, floor: bool, classes: int, cuda: bool = False
    ) -> list[str]:
        """``launches`` for a selector's part of the step (``SCORING``'s value), with or without a re-rank and a
        floor, and ``classes`` size classes of clusters (``benchmarks/step_cost.py`` counts them without a state);
        ``cuda``: PQS's shortlist in one CUDA launch (``pq_shortlist_cuda``)."""
        project, scores = scoring.LAUNCHES
        names = [project, *([] if floor else ["plan"])]
        shortlist = pq_shortlist_cuda.launch_names() if cuda else scoring.SHORTLIST
        names += [*shortlist, *([] if floor else ["refine"])] if rerank else [scores]
        names += ["plan"] if floor else []  # the plan takes the shift and the floor
        return [*names, *["_select_kernel"] * classes, "sparse_pass"]

    def __call__(self, state, query: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        return self.run(state, query, keys, values)[0]

    def run(self, state, query: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Selection]:
        """The step for ``query`` ``[B, Hq, 1, D]`` over the cache ``keys``/``values`` ``[B, Hkv, capacity, D]`` (the
        new row written) → (output ``[B, Hq, 1, D]``, the selection it read)."""
        pipe = state.pipeline
        if query.shape[2] != 1:
            raise ValueError(f"fused static step: one decode query per row, got {query.shape[2]}")
        if query.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
            query, keys, values = query.contiguous(), keys.contiguous(), values.contiguous()  # the kernels' layout
        B, Hq, _, D = query.shape
        H, cap = keys.shape[1], keys.shape[2]
        C = state.num_clusters
        g = Hq // H
        Gs, G = (1, g) if self.shared else (g, 1)
        rows = B * H * Gs
        device = query.device
        prepared, mean_logit, logit_var = self.prologue(state, query, keys, values)
        # Without a floor the plan and the selector's scores do not read what the other writes: in a CUDA graph the
        # plan runs on a second stream of high priority beside the scores (the graph holds two branches). The scores
        # fill the device with programs; the priority lets the plan's in first. Every tensor the second stream touches
        # is allocated on the first, which waits for it.
        scores = torch.empty(rows, cap, dtype=torch.float32, device=device)
        quotas = torch.empty(rows, C, dtype=torch.long, device=device)
        offsets = torch.empty(rows, C, dtype=torch.long, device=device)
        runs = torch.empty(rows, C + 1, dtype=torch.int32, device=device)
        chosen = torch.empty(rows, self.width, dtype=torch.long, device=device)
        log_weight = torch.empty(rows, self.width, dtype=torch.float32, device=device)  # 0: every row is exact
        arrivals = torch.empty(rows, dtype=torch.int32, device=device)  # flash's counters: the plan zeroes them
        outputs = (quotas, offsets, runs, chosen, log_weight, arrivals)
        floor = self.two_stage is not None and self.two_stage.floor > 0
        budget_args = (state.length, state.start, self.density, self.fixed, self.tokens)
        # Only where a CUDA graph is captured: launched eagerly the host's launches set the pace, not the device.
        # (``torch.cuda.stream(None)`` keeps the current stream.)
        side = self.side if self.side is not None and torch.cuda.is_current_stream_capturing() and not floor else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            if not floor:
                self.plan(state, mean_logit, logit_var, None, outputs, H, Gs, G)
        if self.two_stage is None:
            self.scoring.score(state, prepared, scores, G)
        else:  # the scores, the shortlist and its exact logits
            if self.shortlist_cuda and (reason := pq_shortlist_cuda.group_reason(state, Gs * G, Gs)) is not None:
                self.shortlist_cuda, self.shortlist_note = False, reason  # (the same group every step: once)
            shortlist = pq_shortlist_cuda.launch if self.shortlist_cuda else self.scoring.shortlist
            listing = shortlist(self.two_stage, state, prepared, scores, keys, query, budget_args, Gs, G)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
        if floor:  # the plan takes each row's shift and floor (after the join: the floor reads its rows' clusters)
            self.plan(state, mean_logit, logit_var, listing, outputs, H, Gs, G)
        elif self.two_stage is not None:  # each row's shift
            self.two_stage.refine(listing)
        # With a shortlist the scores are boxed: the selection re-ranks as it reads them.
        boxes = (listing.exact, listing.shifts) if self.two_stage is not None else None
        launch_select(scores, state.members, state.member_counts, quotas, offsets, chosen, Gs, self.select_block, boxes)
        selection = Selection(
            chosen.view(B, H, Gs, 1, self.width),
            log_weight.view(B, H, Gs, 1, self.width),
            runs.view(B, H, Gs, 1, C + 1),
        )
        proxies = pipe.tail_proxies(state.pooled, state.assignment)
        stats = (mean_logit, logit_var)  # the prologue's, for the allocation: the proxies need not read Σk, Σk⊙k
        out, _ = pipe.kernel.sparse(query, keys, values, selection, proxies, state.scale, arrivals, stats)
        return out, selection

    def prologue(self, state, query: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The step's first launch: the selector's projection (``scoring.projection``: QGS's projected heads or PQS's
        tables, returned) and the growth — the row leaving the window joined to its QGC cluster, each chunk's logit
        statistics (returned: z̄_b and σ̂_b² ``[B, Hkv, g, 1, C]``)."""
        B, Hq, _, D = query.shape
        H, cap = keys.shape[1], keys.shape[2]
        C, g, rc = state.num_clusters, Hq // H, self.projection.shape[-1]
        mean_logit = torch.empty(B, H, g, 1, C, dtype=torch.float32, device=query.device)
        logit_var = torch.empty_like(mean_logit)
        growth = dict(
            K=keys,
            Q=query,
            LENGTH=state.length,
            V=values,
            PROJ=self.projection,
            CENT=self.centroids,
            ASSIGNMENT=state.assignment,
            COUNT=state.pooled.count,
            KSUM=state.pooled.key_sum,
            VSUM=state.pooled.value_sum,
            KSQ=state.pooled.key_square_sum,
            MEMBERS=state.members,
            MEMBER_COUNT=state.member_counts,
            MEAN_LOGIT=mean_logit,
            LOGIT_VAR=logit_var,
            **dict(zip(("sk_b", "sk_h", "sk_n"), keys.stride()[:3], strict=True)),
            **dict(zip(("sv_b", "sv_h", "sv_n"), values.stride()[:3], strict=True)),
            sq_b=query.stride(0),
            sq_h=query.stride(1),
            Hkv=H,
            CAP=cap,
            C=C,
            S=state.members.shape[-1],
            LOCAL=state.pipeline.spec.local,
            scale=state.scale,
            G=g,
            D=D,
            BLOCK_D=triton.next_power_of_2(D),
            RC=rc,
            BLOCK_RC=triton.next_power_of_2(rc),
            BLOCK_C=max(16, triton.next_power_of_2(C)),
            STATS_C=STATS_CLUSTERS,
            num_warps=4,
        )
        prepared, projection = self.scoring.projection(state, query, keys)
        # The other selector's arguments: placeholders its branch never reads.
        sizes = ("R", "BLOCK_R", "M", "CC", "DIMS", "W", "BLOCK_M", "BLOCK_CC", "BLOCK_DIMS")
        unused = dict(SCALES=prepared, PACKED=False, **dict.fromkeys(sizes, 1))
        prologue[(B * H, 1 + triton.cdiv(C, STATS_CLUSTERS))](**{**unused, **projection, **growth})
        return prepared, mean_logit, logit_var

    def plan(self, state, mean_logit, logit_var, listing, outputs, H, Gs, G):
        """The plan's launch into ``outputs`` (quotas, offsets, runs, the index, its log weights, the flash pass's
        arrivals); with a ``listing`` (a shortlist with a floor), after it: the program takes the row's shift and floor
        first."""
        quotas, offsets, runs, chosen, log_weight, arrivals = outputs
        C = state.num_clusters
        block_c, warps = launch_config(C)
        warps = max(warps, PLAN_WARPS)
        floor = listing is not None
        # Without a floor the shortlist's pointers are never read: any tensor stands in.
        parts = (listing.listed, listing.exact, listing.counts, listing.cut, listing.shifts) if floor else (quotas,) * 5
        listed, exact, counts, cut, shifts = parts
        floor_share = self.two_stage.floor_t if self.two_stage is not None else self.density  # (read with a floor)
        with quiet_interpreter():
            plan[(quotas.shape[0],)](
                mean_logit,
                logit_var,
                state.pooled.count,
                state.length,
                state.start,
                self.density,
                state.fixed_base,
                state.fixed_moves,
                state.assignment,
                floor_share,
                listed,
                counts,
                exact,
                cut,
                shifts,
                quotas,
                offsets,
                runs,
                chosen,
                log_weight,
                arrivals,
                H,
                Gs,
                C,
                self.fixed,
                self.width,
                self.tokens,
                state.assignment.shape[-1],
                listed.shape[-1],
                G=G,
                BLOCK_G=triton.next_power_of_2(G),
                BLOCK_C=block_c,
                BLOCK_F=max(16, triton.next_power_of_2(self.fixed)),
                FLOOR=floor,
                RADIX_BLOCK=stages.RADIX_BLOCK,
                LIBDEVICE=libdevice is not None and not triton_path.interpreting(),
                num_warps=warps,
            )
