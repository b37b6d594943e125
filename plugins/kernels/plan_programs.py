"""The fused decode step's read plan (``flash_step.py`` launches it): each selection row's quotas — ErrorGate's
priority water-filled, after its floor — and its index laid out (``plan_row``). Without a shortlist it is a launch of
its own (``plan``); with one, the last program of the row's listing runs it (``exact_logits`` here, PQS's ``pq_list``):
each of the listing's programs counts its arrival on a counter that starts at zero, an atomic that publishes its
stores, as the flash pass's parts do before their merge."""

from __future__ import annotations

from oa_core.ops.triton_path import tl, triton

if triton is not None:
    from oa_core.ops.selection import select_cluster
    from oa_core.ops.water_filling import water_fill_row
    from oa_plugins.allocators.errorgate import row_log_priority
    from oa_plugins.kernels.two_stage_programs import exact_chunk, floor_counts, row_budget, row_shift


if triton is not None:

    @triton.jit
    def plan_row(
        p,
        MEAN_LOGIT,
        LOGIT_VAR,
        COUNT,
        LENGTH,
        START,
        DENSITY,
        FIXED_BASE,
        FIXED_MOVES,
        ASSIGNMENT,
        FLOOR_SHARE,
        LISTED,
        LISTED_COUNTS,
        EXACT,
        CUT,
        SHIFTS,
        QUOTAS,
        OFFSETS,
        RUNS,
        INDEX,
        LW,
        ARRIVALS,
        Hkv,
        Gs,
        C,
        F,
        WIDTH,
        TOKENS,
        CAP,
        L,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_F: tl.constexpr,
        LISTING: tl.constexpr,
        FLOOR: tl.constexpr,
        RADIX_BLOCK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        """Selection row ``p`` (batch row, KV head, selection head): the quotas, and the row's index laid out; the
        row's counter of the flash pass's parts zeroed (``sparse_pass``'s ``ARRIVALS``). LISTING: after the shortlist,
        whose shift (``row_shift``) the row takes first; FLOOR: and the floor (``floor_counts``) before the rest."""
        b = p // (Gs * Hkv)
        h = (p // Gs) % Hkv
        s = p % Gs
        head = b * Hkv + h
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        count = tl.load(COUNT + head * C + offs_c, mask=c_ok, other=0.0)
        # The row's heads' z̄_b and σ̂_b² (``grow``'s, one launch before, over every head's chunks).
        offs_g = tl.arange(0, BLOCK_G)
        inside = (offs_g[:, None] < G) & c_ok[None, :]
        stats = (head * (G * Gs) + s * G + offs_g[:, None]) * C + offs_c[None, :]
        mean_logit = tl.load(MEAN_LOGIT + stats, mask=inside, other=0.0)
        logit_var = tl.load(LOGIT_VAR + stats, mask=inside, other=0.0)
        row = row_log_priority(mean_logit, logit_var, count, G, LIBDEVICE)
        length = tl.load(LENGTH).to(tl.int64)
        budget = row_budget(LENGTH, START, DENSITY, b, F, TOKENS)
        if LISTING:
            row_shift(LISTED_COUNTS, EXACT, CUT, SHIFTS, p, L, RADIX_BLOCK)
        if FLOOR:  # ErrorGate's floor: its rows first, the rest water-filled up to what each cluster has left
            first = floor_counts(
                ASSIGNMENT,
                LENGTH,
                START,
                DENSITY,
                FLOOR_SHARE,
                LISTED,
                LISTED_COUNTS,
                EXACT,
                p,
                Hkv,
                Gs,
                CAP,
                F,
                TOKENS,
                L,
                RADIX_BLOCK,
                BLOCK_C,
            ).to(tl.int64)
            rest = water_fill_row(
                row.to(tl.float64),
                (count - first.to(tl.float32)).to(tl.float64),
                (budget - tl.sum(first, axis=0)).to(tl.float64),
                offs_c,
                c_ok,
            )
            quotas = first + rest
        else:
            quotas = water_fill_row(row.to(tl.float64), count.to(tl.float64), budget.to(tl.float64), offs_c, c_ok)
        ends = F + tl.cumsum(quotas, axis=0)
        tl.store(QUOTAS + p * C + offs_c, quotas, mask=c_ok)
        tl.store(OFFSETS + p * C + offs_c, ends - quotas, mask=c_ok)
        tl.store(RUNS + p * (C + 1) + 1 + offs_c, ends.to(tl.int32), mask=c_ok)
        tl.store(RUNS + p * (C + 1), (p * 0 + F).to(tl.int32))
        tl.store(ARRIVALS + p, (p * 0).to(tl.int32))
        # The index: the sink and the local window first (the window's slots move with the length), then the runs
        # (written by the selection), then -1 up to the width; every column's log weight 0 (all are exact rows).
        offs_f = tl.arange(0, BLOCK_F)
        f_ok = offs_f < F
        fixed = tl.load(FIXED_BASE + b * F + offs_f, mask=f_ok, other=0) + length * tl.load(
            FIXED_MOVES + offs_f, mask=f_ok, other=0
        )
        tl.store(INDEX + p * WIDTH + offs_f, fixed, mask=f_ok)
        end = F + tl.sum(quotas, axis=0)
        for start in range(0, WIDTH, BLOCK_F):
            cols = start + offs_f
            tl.store(INDEX + p * WIDTH + cols, tl.full([BLOCK_F], -1, tl.int64), mask=(cols >= end) & (cols < WIDTH))
            tl.store(LW + p * WIDTH + cols, tl.zeros([BLOCK_F], tl.float32), mask=cols < WIDTH)

    @triton.jit
    def plan(
        MEAN_LOGIT,
        LOGIT_VAR,
        COUNT,
        LENGTH,
        START,
        DENSITY,
        FIXED_BASE,
        FIXED_MOVES,
        ASSIGNMENT,
        FLOOR_SHARE,
        LISTED,
        LISTED_COUNTS,
        EXACT,
        CUT,
        SHIFTS,
        QUOTAS,
        OFFSETS,
        RUNS,
        INDEX,
        LW,
        ARRIVALS,
        Hkv,
        Gs,
        C,
        F,
        WIDTH,
        TOKENS,
        CAP,
        L,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_F: tl.constexpr,
        LISTING: tl.constexpr,
        FLOOR: tl.constexpr,
        RADIX_BLOCK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        """The plan's own launch, a program per selection row (``plan_row``): for a step without a shortlist."""
        plan_row(
            tl.program_id(0).to(tl.int64),
            MEAN_LOGIT,
            LOGIT_VAR,
            COUNT,
            LENGTH,
            START,
            DENSITY,
            FIXED_BASE,
            FIXED_MOVES,
            ASSIGNMENT,
            FLOOR_SHARE,
            LISTED,
            LISTED_COUNTS,
            EXACT,
            CUT,
            SHIFTS,
            QUOTAS,
            OFFSETS,
            RUNS,
            INDEX,
            LW,
            ARRIVALS,
            Hkv,
            Gs,
            C,
            F,
            WIDTH,
            TOKENS,
            CAP,
            L,
            G,
            BLOCK_G,
            BLOCK_C,
            BLOCK_F,
            LISTING,
            FLOOR,
            RADIX_BLOCK,
            LIBDEVICE,
        )

    @triton.jit
    def exact_logits(
        K,
        Q,
        SCORES,
        FINISHED,
        MEAN_LOGIT,
        LOGIT_VAR,
        COUNT,
        LENGTH,
        START,
        DENSITY,
        FIXED_BASE,
        FIXED_MOVES,
        ASSIGNMENT,
        FLOOR_SHARE,
        LISTED,
        LISTED_COUNTS,
        EXACT,
        CUT,
        SHIFTS,
        QUOTAS,
        OFFSETS,
        RUNS,
        INDEX,
        LW,
        ARRIVALS,
        MEMBERS,
        MEMBER_COUNTS,
        sk_b,
        sk_h,
        sk_n,
        sq_b,
        sq_h,
        Hkv,
        Gs,
        C,
        F,
        WIDTH,
        TOKENS,
        CAP,
        L,
        SLOTS,
        HEAD_STRIDE,
        ROWS,
        CHUNKS,
        SPLIT,
        scale,
        G: tl.constexpr,
        GQ: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_F: tl.constexpr,
        PLAN: tl.constexpr,
        FLOOR: tl.constexpr,
        RADIX_BLOCK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        SELECT: tl.constexpr,
        BLOCK: tl.constexpr,
        LARGE: tl.constexpr,
        FEW: tl.constexpr,
    ):
        """The shortlist's exact logits, each row's plan and, with CLASSES > 0, the per-cluster selection, in one
        launch of ROWS · CHUNKS (+ ROWS · C) programs. Each takes a ticket (``FINISHED + ROWS``, zero before the
        launch), so that the work is handed out in order whatever order the programs start in:

        - tickets below ROWS · CHUNKS: (selection row, chunk of BLOCK_L entries), the entries' exact logits
          (``exact_chunk``); each counts its arrival at ``FINISHED + p`` (zero before the launch), and the row's last
          runs the row's plan (PLAN, ``plan_row``: the shift, with FLOOR the floor, the quotas, the index; without,
          the shift alone: a shortlist on its own, tests', studies') and counts once more: the row is planned;
        - the rest: (selection row, cluster), which waits until its row is planned and selects the cluster's quota
          (``select_planned``).

        The arrivals publish the stores before them (a barrier, then an atomic that releases them at the device's
        scope); the row's last program, and the selection after the plan, acquire them."""
        ticket = tl.atomic_add(FINISHED + ROWS, 1, sem="relaxed", scope="gpu")
        if ticket < ROWS * CHUNKS:
            p = (ticket // CHUNKS).to(tl.int64)
            exact_chunk(
                K,
                Q,
                SCORES,
                LISTED,
                LISTED_COUNTS,
                EXACT,
                p,
                ticket % CHUNKS,
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
                G,
                GQ,
                D,
                BLOCK_D,
                BLOCK_L,
            )
            tl.debug_barrier()
            if tl.atomic_add(FINISHED + p, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
                if PLAN:
                    plan_row(
                        p,
                        MEAN_LOGIT,
                        LOGIT_VAR,
                        COUNT,
                        LENGTH,
                        START,
                        DENSITY,
                        FIXED_BASE,
                        FIXED_MOVES,
                        ASSIGNMENT,
                        FLOOR_SHARE,
                        LISTED,
                        LISTED_COUNTS,
                        EXACT,
                        CUT,
                        SHIFTS,
                        QUOTAS,
                        OFFSETS,
                        RUNS,
                        INDEX,
                        LW,
                        ARRIVALS,
                        Hkv,
                        Gs,
                        C,
                        F,
                        WIDTH,
                        TOKENS,
                        CAP,
                        L,
                        G,
                        BLOCK_G,
                        BLOCK_C,
                        BLOCK_F,
                        True,
                        FLOOR,
                        RADIX_BLOCK,
                        LIBDEVICE,
                    )
                else:
                    row_shift(LISTED_COUNTS, EXACT, CUT, SHIFTS, p, L, RADIX_BLOCK)
                tl.debug_barrier()
                tl.atomic_add(FINISHED + p, 1, sem="release", scope="gpu")  # planned: CHUNKS + 1
        elif SELECT:  # (not compiled without a selection)
            select_planned(
                ticket - ROWS * CHUNKS,
                FINISHED,
                1,
                CHUNKS + 1,
                SCORES,
                MEMBERS,
                MEMBER_COUNTS,
                QUOTAS,
                OFFSETS,
                INDEX,
                EXACT,
                SHIFTS,
                CAP,
                C,
                SLOTS,
                HEAD_STRIDE,
                WIDTH,
                Gs,
                L,
                SPLIT,
                BLOCK,
                LARGE,
                FEW,
            )

    @triton.jit
    def select_planned(
        item,
        FINISHED,
        GROUP,
        PLANNED,
        SCORES,
        MEMBERS,
        MEMBER_COUNTS,
        QUOTAS,
        OFFSETS,
        INDEX,
        EXACT,
        SHIFTS,
        N,
        C,
        S,
        HEAD_STRIDE,
        WIDTH,
        Gs,
        L,
        SPLIT,
        BLOCK: tl.constexpr,
        LARGE: tl.constexpr,
        FEW: tl.constexpr,
    ):
        """A listing launch's selection program ``item``: (selection row p, cluster c), once the row is planned — once
        the counter at ``FINISHED`` + the first row of p's group of GROUP reaches PLANNED (its ticket came after every
        listing program's, all running or done, so the wait ends) — by ``select_cluster`` over the boxed scores: a
        cluster of at most SPLIT rows in registers (BLOCK lanes, or half), a larger one (LARGE: some cluster may be)
        BLOCK rows at a time, so that no path holds more than the first size class's block."""
        p = (item // C).to(tl.int64)
        c = item % C
        counter = FINISHED + (p // GROUP) * GROUP
        planned = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        while planned < PLANNED:
            planned = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        select_cluster(
            p,
            c,
            SCORES,
            MEMBERS,
            MEMBER_COUNTS,
            QUOTAS,
            OFFSETS,
            INDEX,
            EXACT,
            SHIFTS,
            N,
            C,
            S,
            HEAD_STRIDE,
            WIDTH,
            Gs,
            0,
            SPLIT,
            L,
            BLOCK,
            False,
            FEW,
            True,
        )
        if LARGE:
            select_cluster(
                p,
                c,
                SCORES,
                MEMBERS,
                MEMBER_COUNTS,
                QUOTAS,
                OFFSETS,
                INDEX,
                EXACT,
                SHIFTS,
                N,
                C,
                S,
                HEAD_STRIDE,
                WIDTH,
                Gs,
                SPLIT,
                2147483647,
                L,
                BLOCK,
                True,
                FEW,
                True,
            )
