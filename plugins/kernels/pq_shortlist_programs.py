"""The Triton programs of PQS's shortlist in the fused step (``TwoStage.pq_shortlist`` launches them): the scores of
a (batch row, KV head)'s selection rows from one read of the codes with their first radix digit counted, each row's
cut, and the listing with the exact logits (the listed scores boxed). The radix select's pieces are
``two_stage_programs``'."""

from __future__ import annotations

from oa_core.ops.triton_path import tl, triton

if triton is not None:
    from oa_core.ops.selection import listed_box
    from oa_plugins.kernels.two_stage_programs import (
        clustered,
        digit_histogram,
        pick_digit,
        radix_digit,
        row_budget,
        unsigned_key,
    )
    from oa_plugins.selectors.pq import load_codes, lut_sums

    @triton.jit
    def pq_scores(
        TABLES,
        CODES,
        LENGTH,
        START,
        SCORES,
        HIST,
        Hkv,
        CAP,
        SINK,
        LOCAL,
        scale,
        GS: tl.constexpr,
        G: tl.constexpr,
        M: tl.constexpr,
        CC: tl.constexpr,
        W: tl.constexpr,
        PACKED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_GS: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Program (batch row · KV head, chunk of CHUNK positions): PQS's scores of the head's GS selection rows from
        one read of each key's codes — s·max over a row's G query heads of the table sums (``lut_sums``), -inf
        outside the clusters (the sink, the window, padding; the row leaving the window joins a cluster in this step:
        inside) — to SCORES, and each row's histogram of the scores' first 8-bit digit over the chunk added to its
        row of HIST ``[rows, 256]``."""
        head = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * CHUNK
        n = tl.load(LENGTH).to(tl.int64)
        rows = tl.arange(0, BLOCK_GS)
        if first < n:
            offs_m = tl.arange(0, BLOCK_M)
            hist = tl.zeros([BLOCK_GS, 256], tl.int32)
            end = tl.minimum(first + CHUNK, n)
            for start in range(first, end, BLOCK_N):
                offs = start + tl.arange(0, BLOCK_N)
                in_n = offs < end
                both_t = tl.trans(in_n[:, None] & (offs_m[None, :] < M))
                codes_t = tl.trans(load_codes(CODES + head * CAP * W, offs, in_n, W, M, PACKED, BLOCK_M))
                inside = in_n & clustered(offs, START, head // Hkv, SINK, LOCAL, n)
                for s in range(GS):  # a loop, not unrolled: the codes' tile is most of the registers
                    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
                    for j in range(G):
                        table = TABLES + ((head * GS + s) * G + j) * (M * CC)
                        best = tl.maximum(best, lut_sums(table, codes_t, both_t, M, CC, BLOCK_M))
                    value = tl.where(inside, best * scale, float("-inf"))
                    tl.store(SCORES + (head * GS + s) * CAP + offs, value, mask=in_n)
                    digits = tl.histogram(radix_digit(unsigned_key(value), 24, 8), 256, mask=inside)
                    hist = tl.where(rows[:, None] == s, hist + digits[None, :], hist)
            bins = tl.arange(0, 256)
            counted = (rows < GS)[:, None] & (hist > 0)  # the first digit: a few exponents, most bins empty
            tl.atomic_add(HIST + (head * GS + rows[:, None]) * 256 + bins[None, :], hist, mask=counted, sem="relaxed")

    @triton.jit
    def pq_cut(
        SCORES,
        HIST,
        LENGTH,
        START,
        DENSITY,
        MULTIPLE,
        COUNTS,
        CUT,
        TIES,
        PLACES,
        NEAR,
        Hkv,
        GS,
        CAP,
        F,
        TOKENS,
        L,
        S,
        SEGMENT: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """Program per selection row: the shortlist's length k (⌈m·E_sel⌉, at most L and the selectable positions),
        its cut key τ, the ties at τ it takes, and each segment's place (entries and ties at τ before it), from two
        passes over the row. The first digit comes from ``pq_scores``' histogram, the second from a pass; the third
        pass counts, per segment, the keys whose first two digits are above τ's and keeps the positions of those that
        share them (NEAR ``[rows, CAP]``: a few, as a rule); the last digit and the rest of the places come from the
        kept positions alone."""
        p = tl.program_id(0).to(tl.int64)
        row = SCORES + p * CAP
        near = NEAR + p * CAP
        n = tl.load(LENGTH).to(tl.int64)
        hist = tl.load(HIST + p * 256 + tl.arange(0, 256))
        budget = row_budget(LENGTH, START, DENSITY, p // (GS * Hkv), F, TOKENS)
        k = tl.ceil(tl.load(MULTIPLE) * budget.to(tl.float64)).to(tl.int64)
        k = tl.minimum(tl.minimum(k, L), tl.sum(hist, axis=0).to(tl.int64)).to(tl.int32)
        tau = tl.full([], 4294967296, tl.int64)  # no shortlist: above every key
        ties = tl.zeros([], tl.int32)
        segments = tl.arange(0, BLOCK_S)
        above = tl.zeros([BLOCK_S], tl.int32)  # per segment: its keys above τ
        tied = tl.zeros([BLOCK_S], tl.int32)  # and at τ
        if k > 0:
            digit, rest = pick_digit(hist, k, 8)
            prefix = digit.to(tl.int64)
            digit, rest = pick_digit(digit_histogram(row, n, prefix, 16, 8, BLOCK), rest, 8)
            prefix = prefix * 256 + digit  # τ's first two digits
            third = tl.zeros([256], tl.int32)
            kept = tl.zeros([], tl.int32)
            for segment in range(0, S):
                end = tl.minimum((segment + 1) * SEGMENT, n)
                for start in range(segment * SEGMENT, end, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    value = tl.load(row + offs, mask=offs < end, other=float("-inf"))
                    key = unsigned_key(value)
                    ok = (offs < end) & (value > float("-inf"))
                    share = ok & ((key >> 16) == prefix)
                    third += tl.histogram(radix_digit(key, 8, 8), 256, mask=share)
                    slot = kept + tl.cumsum(share.to(tl.int32), axis=0) - 1
                    tl.store(near + slot, offs.to(tl.int32), mask=share)
                    kept += tl.sum(share.to(tl.int32), axis=0)
                    higher = tl.sum((ok & ((key >> 16) > prefix)).to(tl.int32), axis=0)
                    above = tl.where(segments == segment, above + higher, above)
            digit, rest = pick_digit(third, rest, 8)
            prefix = prefix * 256 + digit
            last = tl.zeros([256], tl.int32)
            for start in range(0, kept, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                pos = tl.load(near + offs, mask=offs < kept, other=0)
                key = unsigned_key(tl.load(row + pos, mask=offs < kept, other=float("-inf")))
                last += tl.histogram(radix_digit(key, 0, 8), 256, mask=(offs < kept) & ((key >> 8) == prefix))
            digit, ties = pick_digit(last, rest, 8)
            tau = prefix * 256 + digit
            for start in range(0, kept, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                pos = tl.load(near + offs, mask=offs < kept, other=0)
                key = unsigned_key(tl.load(row + pos, mask=offs < kept, other=float("-inf")))
                where = pos // SEGMENT  # the kept position's segment
                above += tl.histogram(where, BLOCK_S, mask=(offs < kept) & (key > tau))
                tied += tl.histogram(where, BLOCK_S, mask=(offs < kept) & (key == tau))
        tl.store(COUNTS + p, k)
        tl.store(CUT + p, tau)
        tl.store(TIES + p, ties)
        tied_before = tl.cumsum(tied, axis=0) - tied
        place = tl.cumsum(above, axis=0) - above + tl.minimum(tied_before, ties)
        tl.store(PLACES + (p * S + segments) * 2, place, mask=segments < S)
        tl.store(PLACES + (p * S + segments) * 2 + 1, tied_before, mask=segments < S)

    @triton.jit
    def pq_list(
        K,
        Q,
        SCORES,
        LENGTH,
        LISTED,
        EXACT,
        CUT,
        TIES,
        PLACES,
        SCRATCH,
        sk_b,
        sk_h,
        sk_n,
        sq_b,
        sq_h,
        Hkv,
        CAP,
        L,
        S,
        scale,
        GS: tl.constexpr,
        G: tl.constexpr,
        BLOCK_GS: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SEGMENT: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_U: tl.constexpr,
    ):
        """Program (batch row · KV head, segment): the segment's listed positions of each of the head's GS selection
        rows, at the segment's place in the row's shortlist (position order: every key above τ, the ties at τ until
        the row's are taken), and their exact logits (s·max over the row's G query heads of q·k) — a K row read once
        for every row that lists it. SCRATCH: ``(1 + BLOCK_GS) · BLOCK_L`` int32 a program."""
        head = tl.program_id(0).to(tl.int64)
        segment = tl.program_id(1)
        scratch = SCRATCH + (head * S + segment) * ((1 + BLOCK_GS) * BLOCK_L)
        b = head // Hkv
        h = head % Hkv
        n = tl.load(LENGTH).to(tl.int64)
        if segment * SEGMENT < n:
            rows = tl.arange(0, BLOCK_GS)
            row_ok = rows < GS
            p = head * GS + rows  # each selection row's number
            taus = tl.load(CUT + p, mask=row_ok, other=4294967296)
            ties = tl.load(TIES + p, mask=row_ok, other=0)
            counts = tl.load(PLACES + (p * S + segment) * 2, mask=row_ok, other=0)
            tied = tl.load(PLACES + (p * S + segment) * 2 + 1, mask=row_ok, other=0)
            offs_d = tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            end = tl.minimum((segment + 1) * SEGMENT, n)
            for start in range(segment * SEGMENT, end, BLOCK_L):
                offs = start + tl.arange(0, BLOCK_L)
                in_n = offs < end
                grid_ok = row_ok[:, None] & in_n[None, :]
                value = tl.load(SCORES + p[:, None] * CAP + offs[None, :], mask=grid_ok, other=float("-inf"))
                key = unsigned_key(value)
                ok = grid_ok & (value > float("-inf"))
                tie = ok & (key == taus[:, None])
                rank = tied[:, None] + tl.cumsum(tie.to(tl.int32), axis=1) - 1
                keep = ok & ((key > taus[:, None]) | (tie & (rank < ties[:, None])))
                slot = counts[:, None] + tl.cumsum(keep.to(tl.int32), axis=1) - 1
                listed = keep & (slot >= 0) & (slot < L)
                tl.store(LISTED + p[:, None] * L + slot, tl.zeros_like(slot) + offs[None, :].to(tl.int32), mask=listed)
                tl.store(SCORES + p[:, None] * CAP + offs[None, :], listed_box(slot), mask=listed)  # its box
                # The rows some selection row lists, gathered to the front (through the program's scratch), BLOCK_U
                # at a time: their K rows read once, the group's logits taken for them alone.
                union = tl.max(keep.to(tl.int32), axis=0) > 0
                gathered = tl.sum(union.to(tl.int32), axis=0)
                place = tl.cumsum(union.to(tl.int32), axis=0) - 1
                tl.store(scratch + place, offs.to(tl.int32), mask=union)
                slots = scratch + BLOCK_L + rows[:, None] * BLOCK_L + place[None, :]
                tl.store(slots, tl.where(listed, slot, -1), mask=row_ok[:, None] & union[None, :])
                tl.debug_barrier()  # the block's threads see each other's scratch
                for first in range(0, gathered, BLOCK_U):
                    entry = first + tl.arange(0, BLOCK_U)
                    entry_ok = entry < gathered
                    pos = tl.load(scratch + entry, mask=entry_ok, other=0).to(tl.int64)
                    krows = tl.load(
                        K + b * sk_b + h * sk_h + pos[:, None] * sk_n + offs_d[None, :],
                        mask=entry_ok[:, None] & d_ok[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    exact = tl.full([BLOCK_GS, BLOCK_U], float("-inf"), tl.float32)
                    for j in tl.static_range(GS * G):
                        q = tl.load(Q + b * sq_b + (h * GS * G + j) * sq_h + offs_d, mask=d_ok, other=0.0)
                        logit = tl.sum(krows * q.to(tl.float32)[None, :], axis=1)
                        exact = tl.where(rows[:, None] == j // G, tl.maximum(exact, logit[None, :]), exact)
                    at = tl.load(
                        scratch + BLOCK_L + rows[:, None] * BLOCK_L + entry[None, :],
                        mask=row_ok[:, None] & entry_ok[None, :],
                        other=-1,
                    )
                    tl.store(EXACT + p[:, None] * L + at, exact * scale, mask=at >= 0)
                tl.debug_barrier()  # read before the next block writes
                counts += tl.sum(keep.to(tl.int32), axis=1)
                tied += tl.sum(tie.to(tl.int32), axis=1)
