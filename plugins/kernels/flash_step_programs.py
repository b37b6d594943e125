"""The fused decode step's first launch (``prologue``; ``flash_step.py`` launches it): the new row's codes (QGS's or
PQS's) and the query heads in their terms, with the state's growth. The step's read plan: ``plan_programs.py``."""

from __future__ import annotations

from oa_core.ops.triton_path import tl, triton

if triton is not None:
    from oa_core.ops.cluster_stats import moments_tile, store_logit_stats
    from oa_core.static import join_rest
    from oa_plugins.selectors.pq_programs import nearest_code, store_codes


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
    def _project_row(
        head,
        K,
        Q,
        LENGTH,
        BASIS,
        CODES,
        SCALES,
        QP,
        sk_b,
        sk_h,
        sk_n,
        sq_b,
        sq_h,
        Hkv,
        CAP,
        G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        """(batch row, KV head) ``head``: the new row's QGS codes (quantize of kᵀU_r: symmetric int8, a scale per
        row) and the G query heads projected on the same basis (U_rᵀq: what QGS scores with)."""
        b = head // Hkv
        h = head % Hkv
        newest = tl.load(LENGTH).to(tl.int64) - 1
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        basis = tl.load(
            BASIS + (head * D + offs_d[:, None]) * R + offs_r[None, :], mask=d_ok[:, None] & r_ok[None, :], other=0.0
        )
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
    def _pq_project_row(
        head,
        K,
        Q,
        LENGTH,
        CENT,
        CODES,
        TABLES,
        sk_b,
        sk_h,
        sk_n,
        sq_b,
        sq_h,
        Hkv,
        CAP,
        G: tl.constexpr,
        M: tl.constexpr,
        C: tl.constexpr,
        DIMS: tl.constexpr,
        W: tl.constexpr,
        PACKED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_DIMS: tl.constexpr,
    ):
        """(batch row, KV head) ``head``: the new row's PQS codes — in each of the M sub-spaces the nearest of the C
        centroids, as prepare codes every key (``oa_plugins.selectors.pq_programs.nearest_code``), stored as the index
        keeps them (``store_codes``) — and the G query heads' tables q_m·μ_{m,c} (what ``group_lut_scores`` sums),
        rounded to float16 as the selector's (``half_tables``), a tile of BLOCK_C centroids at a time."""
        b = head // Hkv
        h = head % Hkv
        newest = tl.load(LENGTH).to(tl.int64) - 1
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        offs_e = tl.arange(0, BLOCK_DIMS)
        sub = offs_m[:, None] * DIMS + offs_e[None, :]  # [sub-space, dimension in it] → the head's dimension
        sub_ok = m_ok[:, None] & (offs_e[None, :] < DIMS)
        k = tl.load(K + b * sk_b + h * sk_h + newest * sk_n + sub, mask=sub_ok, other=0.0).to(tl.float32)
        code = nearest_code(k[None, :, :], CENT + head * M * C * DIMS, offs_m, m_ok, C, DIMS, BLOCK_DIMS)
        row = tl.zeros([1], tl.int64) + newest
        store_codes(CODES + head * CAP * W, code, row, row >= 0, W, M, PACKED, 1, BLOCK_M)
        for c0 in range(0, C, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            c_ok = offs_c < C
            centre = tl.load(
                CENT + ((head * M + offs_m[:, None, None]) * C + offs_c[None, :, None]) * DIMS + offs_e[None, None, :],
                mask=sub_ok[:, None, :] & c_ok[None, :, None],
                other=0.0,
            )  # [BLOCK_M, BLOCK_C, BLOCK_DIMS]
            for j in tl.static_range(G):
                q = tl.load(Q + b * sq_b + (h * G + j) * sq_h + sub, mask=sub_ok, other=0.0).to(tl.float32)
                # ``half_tables``: rounded to float16, saturating at its largest value
                entry = tl.minimum(tl.maximum(tl.sum(q[:, None, :] * centre, axis=2), -65504.0), 65504.0)
                tl.store(
                    TABLES + ((head * G + j) * M + offs_m[:, None]) * C + offs_c[None, :],
                    entry.to(tl.float16).to(tl.float32),
                    mask=m_ok[:, None] & c_ok[None, :],
                )

    @triton.jit
    def _grow_chunk(
        head,
        chunk,
        K,
        V,
        Q,
        LENGTH,
        PROJ,
        CENT,
        ASSIGNMENT,
        COUNT,
        KSUM,
        VSUM,
        KSQ,
        MEMBERS,
        MEMBER_COUNT,
        MEAN_LOGIT,
        LOGIT_VAR,
        sk_b,
        sk_h,
        sk_n,
        sv_b,
        sv_h,
        sv_n,
        sq_b,
        sq_h,
        Hkv,
        CAP,
        C,
        S,
        LOCAL,
        scale,
        G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        RC: tl.constexpr,
        BLOCK_RC: tl.constexpr,
        BLOCK_C: tl.constexpr,
        STATS_C: tl.constexpr,
    ):
        """(batch row, KV head) ``head``, chunk ``chunk`` of STATS_C clusters: the chunk's clusters after the leaving
        row's join and their logit statistics."""
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
        projection = tl.load(
            PROJ + (head * D + offs_d[:, None]) * RC + offs_rc[None, :], mask=d_ok[:, None] & rc_ok[None, :], other=0.0
        )
        point = tl.sum(k[:, None] * projection, axis=0)
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        centre = tl.load(
            CENT + (head * C + offs_c[:, None]) * RC + offs_rc[None, :], mask=c_ok[:, None] & rc_ok[None, :], other=0.0
        )
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
    def prologue(
        K,
        Q,
        LENGTH,
        SPACE,
        CODES,
        SCALES,
        OUT,
        V,
        PROJ,
        CENT,
        ASSIGNMENT,
        COUNT,
        KSUM,
        VSUM,
        KSQ,
        MEMBERS,
        MEMBER_COUNT,
        MEAN_LOGIT,
        LOGIT_VAR,
        sk_b,
        sk_h,
        sk_n,
        sv_b,
        sv_h,
        sv_n,
        sq_b,
        sq_h,
        Hkv,
        CAP,
        C,
        S,
        LOCAL,
        scale,
        G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        RC: tl.constexpr,
        BLOCK_RC: tl.constexpr,
        BLOCK_C: tl.constexpr,
        STATS_C: tl.constexpr,
        PQ: tl.constexpr,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
        M: tl.constexpr,
        CC: tl.constexpr,
        DIMS: tl.constexpr,
        W: tl.constexpr,
        PACKED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_CC: tl.constexpr,
        BLOCK_DIMS: tl.constexpr,
    ):
        """The step's first launch, a program per (batch row, KV head) and part: part 0 the selector's projection —
        PQ: PQS's codes and tables (``_pq_project_row``: SPACE its centroids, CC a sub-space, OUT the tables), else
        QGS's codes and projected heads (``_project_row``: SPACE its basis, OUT the heads, R its rank) — and part j > 0
        the growth of the j-th chunk of STATS_C clusters (``_grow_chunk``). Neither reads what the other writes (the
        growth reads no codes). The other selector's arguments are placeholders."""
        head = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        if part == 0:
            if PQ:
                _pq_project_row(
                    head,
                    K,
                    Q,
                    LENGTH,
                    SPACE,
                    CODES,
                    OUT,
                    sk_b,
                    sk_h,
                    sk_n,
                    sq_b,
                    sq_h,
                    Hkv,
                    CAP,
                    G,
                    M,
                    CC,
                    DIMS,
                    W,
                    PACKED,
                    BLOCK_M,
                    BLOCK_CC,
                    BLOCK_DIMS,
                )
            else:
                _project_row(
                    head,
                    K,
                    Q,
                    LENGTH,
                    SPACE,
                    CODES,
                    SCALES,
                    OUT,
                    sk_b,
                    sk_h,
                    sk_n,
                    sq_b,
                    sq_h,
                    Hkv,
                    CAP,
                    G,
                    D,
                    BLOCK_D,
                    R,
                    BLOCK_R,
                )
        else:
            _grow_chunk(
                head,
                part - 1,
                K,
                V,
                Q,
                LENGTH,
                PROJ,
                CENT,
                ASSIGNMENT,
                COUNT,
                KSUM,
                VSUM,
                KSQ,
                MEMBERS,
                MEMBER_COUNT,
                MEAN_LOGIT,
                LOGIT_VAR,
                sk_b,
                sk_h,
                sk_n,
                sv_b,
                sv_h,
                sv_n,
                sq_b,
                sq_h,
                Hkv,
                CAP,
                C,
                S,
                LOCAL,
                scale,
                G,
                D,
                BLOCK_D,
                RC,
                BLOCK_RC,
                BLOCK_C,
                STATS_C,
            )
