"""The fused step's two-stage selection: the selector's ``rerank`` (QGS's or PQS's) and ErrorGate's ``floor``
(``oa_core.ops.rerank``, ``ErrorGate.allocate``) in seven launches and the start of the plan's program (their
programs: ``two_stage_programs.py``; PQS's: ``pq_shortlist_programs.py``) between the selector's scores and the
selection, the same rows as the composed step.

A row's shortlist is its ⌈m·E_sel⌉ best positions by the selector's score, ties to the earlier position (the
reference's stable sort). Its cut — the shortlist's last order key (``order_key``) — comes from a radix select of
four 8-bit digits, each pass a program per (selection row, segment of SEGMENT positions) that adds its segment's
histogram of the digit, among the keys whose higher digits are the cut's so far, to the row's (one pass over the row
each, from many programs: one program per row made each pass a chain of latencies):

1–4. ``radix_pass``, levels 0–3; level 0 first sets the scores outside the clusters (sink, window, padding) to
   -inf as the reference masks them, and the last level keeps its histogram per segment;
5. ``cut_row``, a program per row: the cut, the ties at it the shortlist takes, and each segment's place — the
   entries and the ties before it;
6. ``compact``, a program per segment: its shortlisted positions written at its place (position order);
7. ``exact_logits``, a program per (selection row, 32 entries): each listed row's exact logit from K, the largest
   over the selection head's query heads (what the oracle selector scores);
8. the shift that puts each row's unlisted scores below its shortlist's lowest exact logit (``rerank_exact``) and,
   with a floor, the shortlist's best ⌊f·E_sel⌋ by exact logit (the same radix select, over the shortlist) counted
   per cluster: in the plan's program after the join (``plan_programs.plan``), or without a floor in
   ``refine``, a program per row.

The re-ranked scores are never written out. The listing (7, or ``pq_list``) overwrites each listed position's score
with a NaN whose payload is its entry in the shortlist (``listed_box``); the per-cluster selection reads a boxed
score as that entry's exact logit and adds the row's shift to every other (``launch_select``'s ``listing``): the
same keys as ``rerank_exact``'s scores, for L writes instead of a pass that read and wrote each row (two passes of
the four-byte scores per selection row, as many bytes as the codes at G = 4).

PQS's scores and shortlist take three launches instead (``pq_shortlist``): ``pq_scores``, a program per (batch row,
KV head, chunk of SCORE_CHUNK positions), scores every selection row of the head from one read of the codes and adds
the chunk's histogram of the first digit to the row's; ``pq_cut``, a program per row, takes the second and third
digits from a pass over the row each — the second pass keeps the positions that share the cut's first two digits —
and the last digit and the segments' places from the kept positions; ``pq_list``, a program per (batch row, KV head,
segment), lists the segment's rows of every selection row with their exact logits.

The floor's rows are the shortlist's best whenever the floor is at most the shortlist (f ≤ m): ``fused_unsupported``
declines other parameters. Why this shape, and what it costs, is in the README ("Two-stage selection").
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from oa_core.ops.triton_path import triton
from oa_plugins.selectors.pq import code_block, lut_block, packed

if triton is not None:
    from oa_plugins.kernels.pq_shortlist_programs import pq_cut, pq_list, pq_scores
    from oa_plugins.kernels.two_stage_programs import (
        compact,
        cut_row,
        exact_logits,
        radix_pass,
        refine,
    )

SEGMENT = 4096  # positions per program of the row passes (a row of 16 K positions: 4 programs)
SEGMENT_WARPS = 8
PQ_SEGMENT = 1024  # positions per program of PQS's listing
RADIX_BLOCK = 1024  # positions per block of the floor's select, one program over the shortlist
LIST_BLOCK = 32  # shortlist entries per ``exact_logits`` program
# ``pq_list``'s block of positions and the listed rows of a block whose exact logits are taken at a time. At 4 warps
# on an H100, 16 × 16K: blocks of 32 took 1.13× the time of 64, of 128 0.9×, of 256 0.79×; 8 rows at a time 0.84×
# (``shortlist_launch_sweep_h100.json``, each alone; at the 2 warps taken, none timed yet).
PQ_LIST_BLOCK = 64
LIST_GATHER = 16
SCORE_CHUNK = 1024  # positions per program of ``pq_scores`` (one atomic add of its histograms)
# Warps of PQS's three launches: the fastest of 2, 4, 8 (4, 8, 16 for the cut) at 16 × 16K and 2 × 128K on an H100
# (``benchmarks/studies/shortlist_launch_sweep.py``; 4 warps of scores took 1.7× the time of 2, of the listing 1.3×).
SCORE_WARPS, CUT_WARPS, LIST_WARPS = 2, 8, 2


class Listing(NamedTuple):
    """A shortlist (``TwoStage.listing``): per row its positions and exact logits ``[rows, L]``, its length, cut key,
    ties at it and the shift of its unlisted scores (``refine``'s); per segment of positions its place (entries and
    ties before it) ``[rows, S, 2]``."""

    listed: Tensor
    exact: Tensor
    counts: Tensor
    cut: Tensor
    ties: Tensor
    shifts: Tensor
    places: Tensor


class TwoStage:
    """One layer's two-stage constants (made with the fused step, outside any capture)."""

    def __init__(self, multiple: float, floor: float, width: int, capacity: int, device: torch.device) -> None:
        self.floor = floor
        self.longest = min(capacity, math.ceil(multiple * width))  # the reference's bound on the shortlist
        self.multiple_t = torch.tensor(multiple, dtype=torch.float64, device=device)
        self.floor_t = torch.tensor(floor, dtype=torch.float64, device=device)

    def shortlist(
        self, scores: Tensor, keys: Tensor, query: Tensor, state, budget_args: tuple, Gs: int, G: int, local: int
    ) -> Listing:
        """``scores`` ``[rows, capacity]`` (the selector's) → the shortlist (its positions, exact logits, length, last
        key and ties at it, and each segment's place in it): launches 1–7. The row leaving the window counts as joined
        (the join may run beside these)."""
        rows, cap = scores.shape
        H = keys.shape[1]
        listed, exact, counts, cut, ties, _, places = listing = self.listing(rows, cap, scores.device, SEGMENT)
        L, S = listed.shape[1], places.shape[1]
        device = scores.device
        # The radix histograms.
        hist = torch.zeros(rows, 3, 256, dtype=torch.int32, device=device)
        last_digit = torch.empty(rows, S, 257, dtype=torch.int32, device=device)
        length, start, density, fixed, tokens = budget_args
        args = (
            scores,
            length,
            start,
            density,
            self.multiple_t,
            hist,
            last_digit,
            H,
            Gs,
            cap,
            fixed,
            tokens,
            local,
            L,
            S,
        )
        for level in range(4):
            radix_pass[(rows, S)](*args, LEVEL=level, BLOCK=SEGMENT, num_warps=SEGMENT_WARPS)
        cut_row[(rows,)](
            hist,
            last_digit,
            length,
            start,
            density,
            self.multiple_t,
            counts,
            cut,
            ties,
            places,
            H,
            Gs,
            fixed,
            tokens,
            L,
            S,
            BLOCK_S=triton.next_power_of_2(S),
            num_warps=4,
        )
        compact[(rows, S)](scores, length, listed, cut, ties, places, cap, L, S, BLOCK=SEGMENT, num_warps=SEGMENT_WARPS)
        self.exact_logits(listing, scores, keys, query, state.scale, Gs, G)
        return listing

    @staticmethod
    def exact_logits(
        listing: Listing, scores: Tensor, keys: Tensor, query: Tensor, scale: float, Gs: int, G: int, box: bool = True
    ):
        """Each listed row's exact logit into ``listing.exact`` (the largest over the selection row's query heads)
        and, with ``box``, its score boxed, a program per (selection row, LIST_BLOCK entries): launch 7 (and the CUDA
        shortlist's second, ``pq_shortlist_cuda``, whose first launch boxed the scores)."""
        rows, L = listing.listed.shape
        H, D = keys.shape[1], keys.shape[-1]
        exact_logits[(rows, triton.cdiv(L, LIST_BLOCK))](
            keys,
            query,
            scores,
            listing.listed,
            listing.counts,
            listing.exact,
            *keys.stride()[:3],
            query.stride(0),
            query.stride(1),
            H,
            Gs,
            L,
            scores.shape[1],
            scale,
            G=G,
            GQ=G * Gs,
            D=D,
            BLOCK_D=triton.next_power_of_2(D),
            BLOCK_L=LIST_BLOCK,
            BOX=box,
            num_warps=4,
        )

    def listing(self, rows: int, cap: int, device: torch.device, segment: int) -> Listing:
        """A shortlist's buffers, its places by ``segment`` positions (``Listing``)."""
        L, S = max(self.longest, 1), triton.cdiv(cap, segment)
        return Listing(
            torch.empty(rows, L, dtype=torch.int32, device=device),
            torch.empty(rows, L, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.int32, device=device),
            torch.empty(rows, dtype=torch.int64, device=device),
            torch.empty(rows, dtype=torch.int32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(rows, S, 2, dtype=torch.int32, device=device),
        )

    def pq_shortlist(
        self, tables: Tensor, state, scores: Tensor, keys: Tensor, query: Tensor, budget_args: tuple, Gs: int, G: int
    ) -> Listing:
        """PQS's scores into ``scores`` ``[rows, capacity]`` and ``shortlist``'s outputs, in three launches:
        ``pq_scores`` reads each key's codes once for the (batch row, KV head)'s selection rows and counts their
        first digit, ``pq_cut`` finds each row's cut and its segments' places in two passes over the row,
        ``pq_list`` lists each segment's rows with their exact logits (each K row read once for the rows that list
        it)."""
        rows, cap = scores.shape
        B, H, _, M, CC = tables.shape
        D = keys.shape[-1]
        codes = state.index.codes
        listed, exact, counts, cut, ties, _, places = listing = self.listing(rows, cap, scores.device, PQ_SEGMENT)
        L, S = listed.shape[1], places.shape[1]
        length, start, density, fixed, tokens = budget_args
        block_m, block_gs = code_block(M), max(2, triton.next_power_of_2(Gs))
        hist = torch.zeros(rows, 256, dtype=torch.int32, device=scores.device)
        pq_scores[(B * H, triton.cdiv(cap, SCORE_CHUNK))](
            tables,
            codes,
            length,
            start,
            scores,
            hist,
            H,
            cap,
            state.pipeline.spec.sink,
            state.pipeline.spec.local,
            state.scale,
            GS=Gs,
            G=G,
            M=M,
            CC=CC,
            W=codes.shape[-1],
            PACKED=packed(CC),
            BLOCK_M=block_m,
            BLOCK_GS=block_gs,
            CHUNK=SCORE_CHUNK,
            BLOCK_N=min(lut_block(M, SCORE_WARPS), SCORE_CHUNK),
            num_warps=SCORE_WARPS,
        )
        pq_cut[(rows,)](
            scores,
            hist,
            length,
            start,
            density,
            self.multiple_t,
            counts,
            cut,
            ties,
            places,
            torch.empty(rows, cap, dtype=torch.int32, device=scores.device),  # the positions near the cut
            H,
            Gs,
            cap,
            fixed,
            tokens,
            L,
            S,
            SEGMENT=PQ_SEGMENT,
            BLOCK=RADIX_BLOCK,
            BLOCK_S=max(16, triton.next_power_of_2(S)),
            num_warps=CUT_WARPS,
        )
        block_l = min(PQ_LIST_BLOCK, PQ_SEGMENT)
        pq_list[(B * H, S)](
            keys,
            query,
            scores,
            length,
            listed,
            exact,
            cut,
            ties,
            places,
            torch.empty(B * H * S, (1 + block_gs) * block_l, dtype=torch.int32, device=scores.device),
            *keys.stride()[:3],
            query.stride(0),
            query.stride(1),
            H,
            cap,
            L,
            S,
            state.scale,
            GS=Gs,
            G=G,
            BLOCK_GS=block_gs,
            D=D,
            BLOCK_D=triton.next_power_of_2(D),
            SEGMENT=PQ_SEGMENT,
            BLOCK_L=block_l,
            BLOCK_U=LIST_GATHER,
            num_warps=LIST_WARPS,
        )
        return listing

    def refine(self, listing: Listing) -> None:
        """Launch 8 for a shortlist without a floor, a program per row: its shift into ``listing.shifts``. With a floor
        the plan's program takes the shift and the floor (``FusedStep.plan``)."""
        refine[(listing.listed.shape[0],)](
            listing.counts,
            listing.exact,
            listing.cut,
            listing.shifts,
            listing.listed.shape[-1],
            BLOCK=RADIX_BLOCK,
            num_warps=SEGMENT_WARPS,
        )
