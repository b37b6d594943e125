"""The Triton programs of the flash kernel (``flash.py`` launches them and documents the pass): the sparse pass over
each selection row's parts, whose last part to finish merges them."""

from __future__ import annotations

from oa_core.ops.triton_path import tl, triton

if triton is not None:
    from oa_core.ops.cluster_stats import moments_tile


if triton is not None:

    @triton.jit
    def _row(p, Hkv, Gs, T):
        """Selection row p → (batch row as int64 — a batch of long caches passes 2^31 elements —, KV head,
        selection head, query)."""
        return (p // (T * Gs * Hkv)).to(tl.int64), (p // (T * Gs)) % Hkv, (p // T) % Gs, p % T

    @triton.jit
    def _gather_block(
        Q_TILE,
        K,
        V,
        IDX,
        LW,
        p,
        b,
        h,
        offs_k,
        in_range,
        g_ok,
        offs_d,
        d_ok,
        sk_b,
        sk_h,
        sk_n,
        sv_b,
        sv_h,
        sv_n,
        KSEL,
        scale,
        HALF: tl.constexpr,
    ):
        """BLOCK_K index columns of row p → (s·q·k_i ``[BLOCK_G, BLOCK_K]``, the logits z_i = s·q·k_i + ln η_i (-inf
        for padding and padded heads), the columns that hold a row, v_i ``[BLOCK_K, BLOCK_D]``); the keys and values
        of padding columns are not read (zeros)."""
        idx = tl.load(IDX + p * KSEL + offs_k, mask=in_range, other=-1)
        valid = idx >= 0
        row = tl.where(valid, idx, 0)[:, None]
        both = valid[:, None] & d_ok[None, :]
        k = tl.load(K + b * sk_b + h * sk_h + row * sk_n + offs_d[None, :], mask=both, other=0.0)
        v = tl.load(V + b * sv_b + h * sv_h + row * sv_n + offs_d[None, :], mask=both, other=0.0)
        if HALF:  # tensor-core dot of the 16-bit inputs, float32 accumulation
            qk = tl.dot(Q_TILE, tl.trans(k)) * scale
        else:
            qk = tl.dot(Q_TILE.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        log_weight = tl.load(LW + p * KSEL + offs_k, mask=valid, other=0.0)
        z = tl.where(g_ok[:, None] & valid[None, :], qk + log_weight[None, :], float("-inf"))
        return qk, z, valid, v

    @triton.jit
    def _accumulate(m, den, acc, z, v, HALF: tl.constexpr):
        """The online softmax's running (max, Σe^{z−m}, Σe^{z−m}·v) after the columns' logits ``z`` (-inf: none)."""
        m_new = tl.maximum(m, tl.max(z, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        e = tl.exp(z - m_safe[:, None])
        if HALF:  # weights rounded to the values' 16-bit type for the tensor-core dot
            acc = acc * alpha[:, None] + tl.dot(e.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(e, v.to(tl.float32), input_precision="ieee")
        return m_new, den * alpha + tl.sum(e, axis=1), acc

    @triton.jit
    def sparse_pass(
        Q,
        K,
        V,
        IDX,
        LW,
        RUNS,
        KSUM,
        VSUM,
        COUNT,
        KSQ,
        MEAN_LOGIT,
        LOGIT_VAR,
        M_OUT,
        L_OUT,
        ACC_OUT,
        USED_OUT,
        ARRIVALS,
        OUT,
        USED,
        sq_b,
        sq_h,
        sq_t,
        sk_b,
        sk_h,
        sk_n,
        sv_b,
        sv_h,
        sv_n,
        ROWS,
        Hkv,
        Gs,
        T,
        KSEL,
        C,
        PARTS,
        scale,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_K: tl.constexpr,
        CHUNK_C: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PROXY: tl.constexpr,
        SECOND: tl.constexpr,
        STATS: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_PARTS: tl.constexpr,
    ):
        """Program (p, part): its part of row p's softmax, in its own running max. Without proxies the PARTS parts
        share every column; with proxies part j holds the runs of clusters jC', ..., jC' + C' − 1 (C' = CHUNK_C),
        their proxies, and its share of the columns outside the runs (the sink, the window, padding). SECOND: the
        proxies are second-order (``PooledClusters.second_order``). STATS: each query head's z̄_b = s·q·k̄_b and σ̂_b²
        are given (``MEAN_LOGIT``, ``LOGIT_VAR`` ``[B, Hkv, Gs·G, C]``, one query per row: the fused step's prologue
        computed them), so Σk and Σk⊙k are not read. The row's last part to finish merges the row's parts
        (``merge_row``): each part counts its arrival at ``ARRIVALS + p`` (zero before the launch)."""
        p = tl.program_id(0) % ROWS
        part = tl.program_id(0) // ROWS
        b, h, s, t = _row(p, Hkv, Gs, T)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        d_ok = offs_d < D
        head = h * (G * Gs) + s * G + offs_g
        q = tl.load(
            Q + b * sq_b + head[:, None] * sq_h + t * sq_t + offs_d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        used = tl.zeros([], tl.int32)
        runs = RUNS + p * (C + 1)
        if not PROXY:  # every column, split evenly in whole blocks
            per = tl.cdiv(tl.cdiv(KSEL, PARTS), BLOCK_K) * BLOCK_K
            stop = tl.minimum(KSEL, part * per + per)
            for k0 in range(part * per, stop, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                _, z, _, v = _gather_block(
                    q,
                    K,
                    V,
                    IDX,
                    LW,
                    p,
                    b,
                    h,
                    offs_k,
                    offs_k < stop,
                    g_ok,
                    offs_d,
                    d_ok,
                    sk_b,
                    sk_h,
                    sk_n,
                    sv_b,
                    sv_h,
                    sv_n,
                    KSEL,
                    scale,
                    HALF,
                )
                m, den, acc = _accumulate(m, den, acc, z, v, HALF)
        else:
            # The chunk's share of the free columns (the sink, the window, padding: the chunks split them evenly),
            # then its runs: the exact rows, and per cluster the rows read — their count, Σ s·q·k_i and Σ v_i as
            # products with the columns' one-hot clusters — for its proxies. n_T = n_b − |X∩b|,
            # ℓ_b = (s·q·Σk_b − Σ_{X∩b} s·q·k_i)/n_T + ln n_T, and the tail's numerator
            # e^{ℓ_b}·(Σv_b − Σ_{X∩b} v_i)/n_T. One sequence of blocks: a short run and its free share fill one.
            offs_c = part * CHUNK_C + tl.arange(0, CHUNK_C)
            c_ok = offs_c < C
            lo = tl.load(runs + offs_c, mask=c_ok, other=0)
            hi = tl.load(runs + offs_c + 1, mask=c_ok, other=0)
            read_z = tl.zeros([BLOCK_G, CHUNK_C], tl.float32)
            read_n = tl.zeros([CHUNK_C], tl.int32)
            read_v = tl.zeros([CHUNK_C, BLOCK_D], tl.float32)
            read_zz = tl.zeros([BLOCK_G, CHUNK_C], tl.float32)  # SECOND: Σ_{X∩b} (s·q·k_i)²
            read_lo = tl.full([BLOCK_G, CHUNK_C], float("inf"), tl.float32)  # SECOND: min_{X∩b} s·q·k_i
            first = tl.load(runs)
            resume = tl.load(runs + C)
            free = first + KSEL - resume
            per = tl.cdiv(free, PARTS)
            own_free = tl.maximum(tl.minimum(free - part * per, per), 0)
            run_start = tl.load(runs + part * CHUNK_C)
            total = own_free + tl.max(hi, axis=0) - run_start
            for f0 in range(0, total, BLOCK_K):
                offs_f = f0 + tl.arange(0, BLOCK_K)
                offs_x = part * per + offs_f  # among the free columns
                offs_x = tl.where(offs_x < first, offs_x, offs_x - first + resume)
                offs_k = tl.where(offs_f < own_free, offs_x, run_start + offs_f - own_free)
                qk, z, valid, v = _gather_block(
                    q,
                    K,
                    V,
                    IDX,
                    LW,
                    p,
                    b,
                    h,
                    offs_k,
                    offs_f < total,
                    g_ok,
                    offs_d,
                    d_ok,
                    sk_b,
                    sk_h,
                    sk_n,
                    sv_b,
                    sv_h,
                    sv_n,
                    KSEL,
                    scale,
                    HALF,
                )
                member = valid[None, :] & (offs_k[None, :] >= lo[:, None]) & (offs_k[None, :] < hi[:, None])
                read_z += tl.dot(
                    tl.where(g_ok[:, None] & valid[None, :], qk, 0.0),
                    tl.trans(member.to(tl.float32)),
                    input_precision="ieee",
                )
                read_n += tl.sum(member.to(tl.int32), axis=1)
                if HALF:  # a one-hot tile is exact in 16 bits
                    read_v += tl.dot(member.to(v.dtype), v)
                else:
                    read_v += tl.dot(member.to(tl.float32), v.to(tl.float32), input_precision="ieee")
                if SECOND:
                    read_zz += tl.dot(
                        tl.where(g_ok[:, None] & valid[None, :], qk * qk, 0.0),
                        tl.trans(member.to(tl.float32)),
                        input_precision="ieee",
                    )
                    for gi in tl.static_range(G):  # head by head: a [CHUNK_C, BLOCK_K] tile, not all BLOCK_G lanes
                        lane = offs_g[:, None] == gi
                        least = tl.min(
                            tl.where(member, tl.sum(tl.where(lane, qk, 0.0), axis=0)[None, :], float("inf")), axis=1
                        )
                        read_lo = tl.where(lane, tl.minimum(read_lo, least[None, :]), read_lo)
                m, den, acc = _accumulate(m, den, acc, z, v, HALF)
            pooled = (b * Hkv + h) * C + offs_c
            count = tl.load(COUNT + pooled, mask=c_ok, other=0.0)
            tail = count - read_n.to(tl.float32)
            has_tail = c_ok & (tail > 0.5)
            n_tail = tl.where(has_tail, tail, 1.0)
            tile = pooled[:, None] * D + offs_d[None, :]
            if STATS:  # s·q·Σk_b = z̄_b·max(n_b, 1), from the given statistics: [BLOCK_G, CHUNK_C]
                stat = ((b * Hkv + h) * (Gs * G) + s * G + offs_g)[:, None] * C + offs_c[None, :]
                stat_ok = g_ok[:, None] & c_ok[None, :]
                mean_logit = tl.load(MEAN_LOGIT + stat, mask=stat_ok, other=0.0)
                qk_scaled = mean_logit * tl.maximum(count, 1.0)[None, :]
            else:
                key_sum = tl.load(KSUM + tile, mask=c_ok[:, None] & d_ok[None, :], other=0.0)
                qk_scaled = tl.dot(q.to(tl.float32), tl.trans(key_sum), input_precision="ieee") * scale
                mean_logit = qk_scaled / tl.maximum(count, 1.0)[None, :]
            ell = (qk_scaled - read_z) / n_tail[None, :] + tl.log(n_tail)[None, :]
            if SECOND:  # + ln(1 + σ̂_T²/2), the reference kernel's arithmetic
                if STATS:
                    logit_var = tl.load(LOGIT_VAR + stat, mask=stat_ok, other=0.0)
                else:
                    _, variance = moments_tile(
                        key_sum, tl.load(KSQ + tile, mask=c_ok[:, None] & d_ok[None, :], other=0.0), count
                    )
                    q32 = q.to(tl.float32)
                    logit_var = tl.dot(q32 * q32, tl.trans(variance), input_precision="ieee") * (scale * scale)
                n_read = read_n.to(tl.float32)[None, :]
                d1 = read_z - n_read * mean_logit  # Σ_{X∩b} (z_i − z̄_b), and Σ_{X∩b} (z_i − z̄_b)²:
                d2 = read_zz - 2.0 * mean_logit * read_z + n_read * mean_logit * mean_logit
                tail_var = tl.maximum(
                    (count[None, :] * logit_var - d2 - d1 * d1 / n_tail[None, :]) / n_tail[None, :], 0.0
                )
                gap = tl.maximum(read_lo - (mean_logit - d1 / n_tail[None, :]), 0.0)  # M_b − z̄_T (inf: none read)
                ell += tl.log(1.0 + 0.5 * tl.minimum(tail_var, gap * gap))
            ell = tl.where(g_ok[:, None] & has_tail[None, :], ell, float("-inf"))
            rest = tl.load(VSUM + tile, mask=c_ok[:, None] & d_ok[None, :], other=0.0) - read_v
            m_new = tl.maximum(m, tl.max(ell, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            e = tl.exp(ell - m_safe[:, None])  # 0 for clusters without a tail
            acc = acc * alpha[:, None] + tl.dot(e / n_tail[None, :], rest, input_precision="ieee")
            den = den * alpha + tl.sum(e, axis=1)
            m = m_new
            used = tl.sum(has_tail.to(tl.int32), axis=0)
        out = (p * PARTS + part) * G + offs_g
        tl.store(M_OUT + out, m, mask=g_ok)
        tl.store(L_OUT + out, den, mask=g_ok)
        tl.store(ACC_OUT + out[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(USED_OUT + p * PARTS + part, used)
        # The arrival: after every thread's stores (the barrier), released with them at the device's scope; the last
        # part acquires the others' and merges.
        tl.debug_barrier()
        if tl.atomic_add(ARRIVALS + p, 1, sem="acq_rel", scope="gpu") == PARTS - 1:
            merge_row(
                p, M_OUT, L_OUT, ACC_OUT, USED_OUT, OUT, USED, Hkv, Gs, T, PARTS, G, BLOCK_G, D, BLOCK_D, BLOCK_PARTS
            )

    @triton.jit
    def merge_row(
        p,
        M_IN,
        L_IN,
        ACC_IN,
        USED_IN,
        OUT,
        USED,
        Hkv,
        Gs,
        T,
        PARTS,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_PARTS: tl.constexpr,
    ):
        """Row p's parts: their numerators and denominators rescaled to one max and summed, divided, written in the
        query's layout and dtype; the proxies used, summed. The parts are read past the L1 cache (``.cg``): other
        programs wrote them."""
        b, h, s, t = _row(p, Hkv, Gs, T)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_p = tl.arange(0, BLOCK_PARTS)
        g_ok = offs_g < G
        both = g_ok[:, None] & (offs_d[None, :] < D)
        top = tl.max(
            tl.load(
                M_IN + (p * PARTS + offs_p[:, None]) * G + offs_g[None, :],
                mask=(offs_p[:, None] < PARTS) & g_ok[None, :],
                other=float("-inf"),
                cache_modifier=".cg",
            ),
            axis=0,
        )
        top = tl.where(top == float("-inf"), 0.0, top)
        den = tl.zeros([BLOCK_G], tl.float32)
        numerator = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for part in range(0, PARTS):
            rows = (p * PARTS + part) * G + offs_g
            m = tl.load(M_IN + rows, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
            w = tl.exp(m - top)  # 0 for a part that read nothing
            den += w * tl.load(L_IN + rows, mask=g_ok, other=0.0, cache_modifier=".cg")
            acc = tl.load(ACC_IN + rows[:, None] * D + offs_d[None, :], mask=both, other=0.0, cache_modifier=".cg")
            numerator += w[:, None] * acc
        head = h * (G * Gs) + s * G + offs_g
        out = numerator / tl.where(g_ok, den, 1.0)[:, None]  # padding lanes: no 0/0
        tl.store(
            OUT + ((b * (Hkv * G * Gs) + head[:, None]) * T + t) * D + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=both,
        )
        used = tl.load(USED_IN + p * PARTS + offs_p, mask=offs_p < PARTS, other=0, cache_modifier=".cg")
        tl.store(USED + p, tl.sum(used, axis=0))
