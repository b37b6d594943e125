"""The Triton programs of the two-stage selection (``two_stage.py`` launches them): the radix select of each row's
threshold, the shortlist's compaction, its exact logits (the listed scores boxed) and each row's shift and floor."""

from __future__ import annotations

from oa_core.ops.triton_path import tl, triton

if triton is not None:
    from oa_core.ops.selection import listed_box, order_key

    @triton.jit
    def row_budget(LENGTH, START, DENSITY, b, F, TOKENS):
        """E_sel of batch row ``b``: the spec's budget for its valid length (``Budget.rows``), less the sink and
        the local window F, at least 0 (int64)."""
        length = tl.load(LENGTH).to(tl.int64)
        valid = length - tl.load(START + b)
        if TOKENS >= 0:  # noqa: SIM108 (Triton compiles a ternary otherwise than an if: both sides made tensors)
            budget = valid * 0 + TOKENS
        else:
            budget = tl.floor(valid.to(tl.float64) * tl.load(DENSITY)).to(tl.int64)
        return tl.maximum(budget - F, 0)

    @triton.jit
    def clustered(offs, START, b, SINK, LOCAL, n):
        """Whether positions ``offs`` of batch row ``b`` are in the clusters at length ``n``: the range [start + sink,
        n − 1 − local] (``StaticState``; the row leaving the window counts: it joins a cluster in this step), tested
        instead of reading each position's cluster."""
        return (offs >= tl.load(START + b) + SINK) & (offs <= n - 1 - LOCAL)

    @triton.jit
    def unsigned_key(score):
        """float32 → int64 in [0, 2^32) with the scores' order (``order_key`` shifted)."""
        return order_key(score).to(tl.int64) + 2147483648

    @triton.jit
    def radix_digit(key, SHIFT: tl.constexpr, BITS: tl.constexpr):
        return ((key >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32)

    @triton.jit
    def digit_histogram(VALUES, n, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
        """How many of ``VALUES[:n]`` (-inf excluded) whose key's bits above SHIFT + BITS are ``prefix`` have each
        value of the BITS bits at SHIFT."""
        hist = tl.zeros([1 << BITS], tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            value = tl.load(VALUES + offs, mask=offs < n, other=float("-inf"))
            key = unsigned_key(value)
            ok = (offs < n) & (value > float("-inf")) & ((key >> (SHIFT + BITS)) == prefix)
            hist += tl.histogram(radix_digit(key, SHIFT, BITS), 1 << BITS, mask=ok)
        return hist

    @triton.jit
    def pick_digit(hist, rest, BITS: tl.constexpr):
        """The largest digit v with count(digit ≥ v) ≥ ``rest`` (those above v are taken whole) → (v, what is left
        of ``rest`` for the digits below)."""
        bins = tl.arange(0, 1 << BITS)
        inclusive = tl.cumsum(hist, axis=0)
        total = tl.sum(hist, axis=0)
        at_or_above = total - inclusive + hist
        digit = tl.max(tl.where(at_or_above >= rest, bins, -1), axis=0)
        return digit, rest - tl.sum(tl.where(bins == digit, total - inclusive, 0), axis=0)

    @triton.jit
    def _radix_select(VALUES, n, k, BLOCK: tl.constexpr):
        """The ``k``-th largest (1 ≤ k ≤ their count) of ``VALUES[:n]`` (-inf excluded) as its unsigned key τ, and how
        many of those tied at τ are among the k (the rest of k is above τ): four digits of 8 bits, a pass each, in one
        program (the floor's select over a shortlist; a row's scores take ``radix_pass``'s segments instead)."""
        prefix = tl.zeros([], tl.int64)
        rest = k
        for d in tl.static_range(4):
            digit, rest = pick_digit(digit_histogram(VALUES, n, prefix, 24 - 8 * d, 8, BLOCK), rest, 8)
            prefix = prefix * 256 + digit
        return prefix, rest

    @triton.jit
    def _kept(key, ok, tau, ties, tied_before):
        """The lanes among the k best: above τ, or tied at τ within the first ``ties`` (``tied_before`` earlier
        ties in the row) → (kept lanes, ties in this block)."""
        tie = ok & (key == tau)
        rank = tied_before + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        return ok & ((key > tau) | (tie & (rank < ties))), tl.sum(tie.to(tl.int32), axis=0)

    @triton.jit
    def _row_k(HIST, LENGTH, START, DENSITY, MULTIPLE, p, b, F, TOKENS, L):
        """The shortlist's length: ⌈m·E_sel⌉, at most L and the selectable positions (the first digit's count)."""
        budget = row_budget(LENGTH, START, DENSITY, b, F, TOKENS)
        k = tl.ceil(tl.load(MULTIPLE) * budget.to(tl.float64)).to(tl.int64)
        selectable = tl.sum(tl.load(HIST + p * 768 + tl.arange(0, 256)), axis=0)
        return tl.minimum(tl.minimum(k, L), selectable.to(tl.int64)).to(tl.int32)

    @triton.jit
    def _prefix(HIST, p, k, LEVELS: tl.constexpr):
        """The shortlist's cut key's first LEVELS digits, from the row's histograms → (prefix, what is left of k)."""
        prefix = tl.zeros([], tl.int64)
        rest = k
        for d in tl.static_range(LEVELS):
            digit, rest = pick_digit(tl.load(HIST + (p * 3 + d) * 256 + tl.arange(0, 256)), rest, 8)
            prefix = prefix * 256 + digit
        return prefix, rest

    @triton.jit
    def radix_pass(
        SCORES,
        LENGTH,
        START,
        DENSITY,
        MULTIPLE,
        HIST,
        LAST,
        Hkv,
        Gs,
        CAP,
        F,
        TOKENS,
        LOCAL,
        L,
        S,
        LEVEL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Program (selection row, segment), digit LEVEL of the shortlist's cut: the segment's histogram of that
        digit among the keys whose higher digits are the cut's, added to the row's (the last digit's: kept per
        segment, with the count above the prefix, for ``compact``). Level 0 first sets the scores outside the
        clusters to -inf (the sink, the window, padding: as the reference masks them; the row leaving the window
        joins a cluster in this step, maybe beside: inside)."""
        p = tl.program_id(0).to(tl.int64)
        segment = tl.program_id(1)
        row = SCORES + p * CAP
        n = tl.load(LENGTH).to(tl.int64)
        offs = segment * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        if LEVEL == 0:
            outside = ~clustered(offs, START, p // (Gs * Hkv), F - LOCAL, LOCAL, n)
            value = tl.where(outside, float("-inf"), tl.load(row + offs, mask=ok, other=float("-inf")))
            tl.store(row + offs, value, mask=ok & outside)
            if segment * BLOCK < n:
                hist = tl.histogram(radix_digit(unsigned_key(value), 24, 8), 256, mask=ok & ~outside)
                tl.atomic_add(HIST + p * 768 + tl.arange(0, 256), hist, sem="relaxed")
        else:
            k = _row_k(HIST, LENGTH, START, DENSITY, MULTIPLE, p, p // (Gs * Hkv), F, TOKENS, L)
            prefix, rest = _prefix(HIST, p, k, LEVEL)
            value = tl.load(row + offs, mask=ok, other=float("-inf"))
            key = unsigned_key(value)
            ok = ok & (value > float("-inf"))
            counted = ok & ((key >> (32 - 8 * LEVEL)) == prefix)
            hist = tl.histogram(radix_digit(key, 24 - 8 * LEVEL, 8), 256, mask=counted)
            hist = tl.where(k > 0, hist, 0)  # no shortlist: nothing counted
            if LEVEL < 3:
                if segment * BLOCK < n:
                    tl.atomic_add(HIST + (p * 3 + LEVEL) * 256 + tl.arange(0, 256), hist, sem="relaxed")
            else:  # the last digit's histogram and the count above the prefix, per segment
                above = tl.where(k > 0, tl.sum((ok & ((key >> 8) > prefix)).to(tl.int32), axis=0), 0)
                tl.store(LAST + (p * S + segment) * 257 + tl.arange(0, 256), hist)
                tl.store(LAST + (p * S + segment) * 257 + 256, above)

    @triton.jit
    def cut_row(
        HIST,
        LAST,
        LENGTH,
        START,
        DENSITY,
        MULTIPLE,
        COUNTS,
        CUT,
        TIES,
        PLACES,
        Hkv,
        Gs,
        F,
        TOKENS,
        L,
        S,
        BLOCK_S: tl.constexpr,
    ):
        """Program per selection row: the shortlist's length k, its cut key τ (every key above it is listed), the
        ties at τ listed, and each segment's place: (entries before it, ties at τ before it)."""
        p = tl.program_id(0).to(tl.int64)
        k = _row_k(HIST, LENGTH, START, DENSITY, MULTIPLE, p, p // (Gs * Hkv), F, TOKENS, L)
        prefix, rest = _prefix(HIST, p, k, 3)
        segments = tl.arange(0, BLOCK_S)
        bins = tl.arange(0, 256)
        inside = segments < S
        last = tl.load(LAST + (p * S + segments[:, None]) * 257 + bins[None, :], mask=inside[:, None], other=0)
        digit, ties = pick_digit(tl.sum(last, axis=0), rest, 8)
        # Per segment: listed entries (above the prefix, or at it with a larger last digit) and ties at τ.
        above = tl.load(LAST + (p * S + segments) * 257 + 256, mask=inside, other=0)
        above += tl.sum(tl.where(bins[None, :] > digit, last, 0), axis=1)
        tied = tl.sum(tl.where(bins[None, :] == digit, last, 0), axis=1)
        tied_before = tl.cumsum(tied, axis=0) - tied
        slot = tl.cumsum(above, axis=0) - above + tl.minimum(tied_before, ties)
        tl.store(PLACES + (p * S + segments) * 2, slot, mask=inside)
        tl.store(PLACES + (p * S + segments) * 2 + 1, tied_before, mask=inside)
        tl.store(COUNTS + p, k)
        tl.store(CUT + p, tl.where(k > 0, prefix * 256 + digit, 4294967296))  # no shortlist: above every key
        tl.store(TIES + p, ties)

    @triton.jit
    def compact(SCORES, LENGTH, LISTED, CUT, TIES, PLACES, CAP, L, S, BLOCK: tl.constexpr):
        """Program (selection row, segment): the segment's shortlisted positions written at its place in the row's
        shortlist (position order: every key above τ, and the ties at τ until the row's are taken)."""
        p = tl.program_id(0).to(tl.int64)
        segment = tl.program_id(1)
        n = tl.load(LENGTH).to(tl.int64)
        if segment * BLOCK < n:
            offs = segment * BLOCK + tl.arange(0, BLOCK)
            value = tl.load(SCORES + p * CAP + offs, mask=offs < n, other=float("-inf"))
            keep, _ = _kept(
                unsigned_key(value),
                (offs < n) & (value > float("-inf")),
                tl.load(CUT + p),
                tl.load(TIES + p),
                tl.load(PLACES + (p * S + segment) * 2 + 1),
            )
            slot = tl.load(PLACES + (p * S + segment) * 2) + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(LISTED + p * L + slot, offs.to(tl.int32), mask=keep & (slot >= 0) & (slot < L))  # never past it

    @triton.jit
    def exact_logits(
        K,
        Q,
        SCORES,
        LISTED,
        COUNTS,
        EXACT,
        sk_b,
        sk_h,
        sk_n,
        sq_b,
        sq_h,
        Hkv,
        Gs,
        L,
        CAP,
        scale,
        G: tl.constexpr,
        GQ: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BOX: tl.constexpr,
    ):
        """Program (selection row, chunk): s·max over the row's G query heads of q·k, for the chunk's listed rows;
        with BOX their scores boxed (``listed_box``: the selection reads the exact logits through them)."""
        p = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * BLOCK_L
        n = tl.load(COUNTS + p)
        if first < n:
            b = p // (Gs * Hkv)
            h = (p // Gs) % Hkv
            s = p % Gs
            offs = first + tl.arange(0, BLOCK_L)
            ok = offs < n
            pos = tl.load(LISTED + p * L + offs, mask=ok, other=0).to(tl.int64)
            pos_ok = ok & (pos >= 0) & (pos < CAP)  # a listed position is a slot of the cache (never read past it)
            offs_d = tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            k = tl.load(
                K + b * sk_b + h * sk_h + pos[:, None] * sk_n + offs_d[None, :],
                mask=pos_ok[:, None] & d_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            best = tl.full([BLOCK_L], float("-inf"), tl.float32)
            for j in tl.static_range(G):
                q = tl.load(Q + b * sq_b + (h * GQ + s * G + j) * sq_h + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                best = tl.maximum(best, tl.sum(k * q[None, :], axis=1))
            tl.store(EXACT + p * L + offs, best * scale, mask=ok)
            if BOX:
                tl.store(SCORES + p * CAP + pos, listed_box(offs.to(tl.int32)), mask=pos_ok)

    @triton.jit
    def row_shift(COUNTS, EXACT, CUT, SHIFTS, p, L, BLOCK: tl.constexpr):
        """Selection row ``p``'s shift of its unlisted scores, (lowest exact − the last listed score) − 1
        (``rerank_exact``; 0 with an empty shortlist), stored at ``SHIFTS + p``: the selection adds it as it reads
        them (the listed ones are boxed: ``listed_box``)."""
        k = tl.load(COUNTS + p)
        lowest = tl.full([], float("inf"), tl.float32)
        for start in range(0, k, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            lowest = tl.minimum(lowest, tl.min(tl.load(EXACT + p * L + offs, mask=offs < k, other=float("inf")), 0))
        bits = (tl.load(CUT + p) - 2147483648).to(tl.int32)  # ``order_key`` undone: the last listed score
        last = tl.where(bits < 0, (-bits) | -2147483648, bits).to(tl.float32, bitcast=True)
        tl.store(SHIFTS + p, tl.where(k > 0, (lowest - last) - 1.0, 0.0))

    @triton.jit
    def floor_counts(
        ASSIGNMENT,
        LENGTH,
        START,
        DENSITY,
        FLOOR_SHARE,
        LISTED,
        COUNTS,
        EXACT,
        p,
        Hkv,
        Gs,
        CAP,
        F,
        TOKENS,
        L,
        BLOCK: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """Selection row ``p``'s floor → its rows per cluster ``[BLOCK_C]`` int32: the shortlist's best ⌊f·E_sel⌋ by
        exact logit, ties to the earlier position (a radix select over the shortlist)."""
        exact = EXACT + p * L
        k = tl.load(COUNTS + p)
        budget = row_budget(LENGTH, START, DENSITY, p // (Gs * Hkv), F, TOKENS)
        k2 = tl.floor(tl.load(FLOOR_SHARE) * budget.to(tl.float64)).to(tl.int64)
        k2 = tl.minimum(k2, k.to(tl.int64)).to(tl.int32)
        hist = tl.zeros([BLOCK_C], tl.int32)
        if k2 > 0:
            tau2, ties2 = _radix_select(exact, k, k2, BLOCK)
            tied = tl.zeros([], tl.int32)
            for start in range(0, k, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                value = tl.load(exact + offs, mask=offs < k, other=float("-inf"))
                keep, block_ties = _kept(unsigned_key(value), offs < k, tau2, ties2, tied)
                pos = tl.load(LISTED + p * L + offs, mask=keep, other=0).to(tl.int64)
                cluster = tl.load(ASSIGNMENT + (p // Gs) * CAP + pos, mask=keep & (pos >= 0) & (pos < CAP), other=0).to(
                    tl.int32
                )
                hist += tl.histogram(cluster, BLOCK_C, mask=keep)
                tied += block_ties
        return hist

    @triton.jit
    def refine(COUNTS, EXACT, CUT, SHIFTS, L, BLOCK: tl.constexpr):
        """Program per selection row of a shortlist without a floor: its shift (``row_shift``). With a floor, the
        plan's program takes the shift and the floor (``plan_programs.plan``)."""
        row_shift(COUNTS, EXACT, CUT, SHIFTS, tl.program_id(0).to(tl.int64), L, BLOCK)
