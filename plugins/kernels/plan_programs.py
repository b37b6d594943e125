"""The fused decode step's read plan (``flash_step.py`` launches it): each selection row's quotas — ErrorGate's
priority water-filled, after its floor — and its index laid out."""

from __future__ import annotations

from oa_core.ops.triton_path import tl, triton

if triton is not None:
    from oa_core.ops.water_filling import water_fill_row
    from oa_plugins.allocators.errorgate import row_log_priority
    from oa_plugins.kernels.two_stage_programs import floor_counts, row_budget, row_shift


if triton is not None:

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
        FLOOR: tl.constexpr,
        RADIX_BLOCK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        """Program (batch row, KV head, selection head): the quotas, and the row's index laid out; the row's counter
        of the flash pass's parts zeroed (``sparse_pass``'s ``ARRIVALS``). FLOOR: after the shortlist, whose shift
        (``row_shift``) and floor (``floor_counts``) the program takes first."""
        p = tl.program_id(0).to(tl.int64)
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
        if FLOOR:  # ErrorGate's floor: its rows first, the rest water-filled up to what each cluster has left
            row_shift(LISTED_COUNTS, EXACT, CUT, SHIFTS, p, L, RADIX_BLOCK)
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
