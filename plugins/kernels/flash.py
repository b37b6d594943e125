"""OpenAttention.flash — Triton decode kernels for docs/design.md step 7.

Per selection row p (a batch row, KV head, selection head and query) the exact rows X_p are read by index and the G
query heads that share the selection (the whole GQA group with ``gqa: shared``, one head otherwise) are served by
each row read. A selection from the pipeline lists each cluster's selected rows as one run (``Selection.runs``); one
without runs is regrouped by cluster first. Four kernels; each KV byte is read once:

1. ``_exact_logits`` (a program per block of index columns): z_i = s·q·k_i + ln η_i (float32, a K-wide buffer).
2. ``_proxies`` (a program per row, its clusters a tile of 16 at a time): from each cluster's run of logits
   and the pooled sums minus the rows read, without reading a key again: n_T = n_b − |X∩b|,
   ℓ_b = (s·q·Σk_b − Σ_{X∩b} z_i)/n_T + ln n_T, the per-token weight g_b = e^{ℓ_b}/n_T (stored), and the row's
   proxy part of the softmax, Σ_b g_b Σv_b over Σ_b e^{ℓ_b}. The per-cluster sums are matrix products (with the
   columns' one-hot clusters, the pooled key and value sums), not a loop over clusters: one cluster after another
   is latency-bound.
3. ``_weighted_values`` (flash-decoding style, a program per row and split of the columns): reads the values of its
   split once. The proxy numerator Σ_b e^{ℓ_b} v̄_T = Σ_b g_b Σv_b − Σ_{i∈X} g_{c(i)} v_i folds into the row weights
   e^{z_i} − g_{c(i)} (a column's cluster follows from the runs), so the rows read need no per-cluster sums.
4. ``_merge``: the parts (the value pass's splits, the proxies' part) rescaled to one max, summed, divided, written in the query's layout
   and dtype.

Each kernel's programs form one 1-D grid with the selection row varying fastest (keeping a row's programs together
was slower).

Inputs may be float32, float16 or bfloat16; accumulation is float32. 16-bit inputs use tensor-core dots for q·k and
w·v; everything else (and float32 inputs throughout) uses ``ieee`` float32 dots, no TF32.
Where there is no CUDA device (and no ``TRITON_INTERPRET=1``) or no Triton, ``attend`` runs the torch reference and
says why in ``note``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from oa_core import hookimpl, triton_path
from oa_core.components import Kernel, PooledClusters, Selection
from oa_core.triton_path import tl, triton
from oa_plugins.kernels.reference import TorchKernel


if triton is not None:

    @triton.jit
    def _row(p, Hkv, Gs, T):
        """Selection row p → (batch row as int64 — a batch of long caches passes 2^31 elements —, KV head,
        selection head, query)."""
        return (p // (T * Gs * Hkv)).to(tl.int64), (p // (T * Gs)) % Hkv, (p // T) % Gs, p % T

    @triton.jit
    def _exact_logits(Q, K, IDX, LW, Z,
                      sq_b, sq_h, sq_t, sk_b, sk_h, sk_n,
                      ROWS, Hkv, Gs, T, KSEL, scale,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr):
        """Program (p, block): z_i = s·q·k_i + ln η_i of BLOCK_K index columns (-inf for padding)."""
        p = tl.program_id(0) % ROWS
        block = tl.program_id(0) // ROWS
        b, h, s, t = _row(p, Hkv, Gs, T)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_k = block * BLOCK_K + tl.arange(0, BLOCK_K)
        head = h * (G * Gs) + s * G + offs_g
        q = tl.load(Q + b * sq_b + head[:, None] * sq_h + t * sq_t + offs_d[None, :],
                    mask=(offs_g[:, None] < G) & (offs_d[None, :] < D), other=0.0)
        in_row = offs_k < KSEL
        idx = tl.load(IDX + p * KSEL + offs_k, mask=in_row, other=-1)
        valid = idx >= 0
        k = tl.load(K + b * sk_b + h * sk_h + tl.where(valid, idx, 0)[:, None] * sk_n + offs_d[None, :],
                    mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)
        if HALF:  # tensor-core dot of the 16-bit inputs, float32 accumulation
            z = tl.dot(q, tl.trans(k)) * scale
        else:
            z = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        z = z + tl.load(LW + p * KSEL + offs_k, mask=in_row, other=0.0)[None, :]
        z = tl.where(valid[None, :], z, float("-inf"))
        tl.store(Z + (p * G + offs_g[:, None]) * KSEL + offs_k[None, :], z,
                 mask=(offs_g[:, None] < G) & in_row[None, :])

    @triton.jit
    def _proxies(Z, IDX, LW, RUNS, Q, KSUM, VSUM, COUNT, LOG_G, M_OUT, L_OUT, ACC_OUT, USED_OUT,
                 sq_b, sq_h, sq_t, ROWS, Hkv, Gs, T, KSEL, C, PER_PROGRAM, PROGRAMS, PARTS, scale,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_C: tl.constexpr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program p: every cluster's proxy, CHUNK_C clusters at a time as one tile. A chunk's runs are contiguous
        columns: one pass over them sums each cluster's logits Σ_{X∩b} s·q·k_i and rows read as a product with the
        columns' one-hot cluster tile; then ℓ_b for the whole chunk (q·Σk_b a product with the chunk's pooled key
        sums), ln g_b = ℓ_b − ln n_T (stored for the value pass), and the chunk's part of the softmax,
        Σ_b e^{ℓ_b} Σv_b / n_T (a product with its pooled value sums), kept in a running max."""
        p = tl.program_id(0) % ROWS
        part = tl.program_id(0) // ROWS  # clusters part·PER_PROGRAM, ... (PER_PROGRAM: a multiple of CHUNK_C)
        b, h, s, t = _row(p, Hkv, Gs, T)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        d_ok = offs_d < D
        head = h * (G * Gs) + s * G + offs_g
        q = tl.load(Q + b * sq_b + head[:, None] * sq_h + t * sq_t + offs_d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        runs = RUNS + p * (C + 1)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        used = tl.zeros([], tl.int32)
        for c0 in range(part * PER_PROGRAM, tl.minimum(part * PER_PROGRAM + PER_PROGRAM, C), CHUNK_C):
            offs_c = c0 + tl.arange(0, CHUNK_C)
            c_ok = offs_c < C
            lo = tl.load(runs + offs_c, mask=c_ok, other=0)
            hi = tl.load(runs + offs_c + 1, mask=c_ok, other=0)
            read_z = tl.zeros([BLOCK_G, CHUNK_C], tl.float32)  # Σ_{X∩b} s·q·k_i
            read_n = tl.zeros([CHUNK_C], tl.int32)
            for start in range(tl.load(runs + c0), tl.load(runs + tl.minimum(c0 + CHUNK_C, C)), BLOCK_K):
                offs_k = start + tl.arange(0, BLOCK_K)
                valid = tl.load(IDX + p * KSEL + offs_k, mask=offs_k < KSEL, other=-1) >= 0
                z = tl.load(Z + (p * G + offs_g[:, None]) * KSEL + offs_k[None, :],
                            mask=g_ok[:, None] & valid[None, :], other=0.0)
                z = z - tl.load(LW + p * KSEL + offs_k, mask=valid, other=0.0)[None, :]
                z = tl.where(g_ok[:, None] & valid[None, :], z, 0.0)
                one_hot = valid[:, None] & (offs_k[:, None] >= lo[None, :]) & (offs_k[:, None] < hi[None, :])
                read_z += tl.dot(z, one_hot.to(tl.float32), input_precision="ieee")
                read_n += tl.sum(one_hot.to(tl.int32), axis=0)
            pooled = (b * Hkv + h) * C + offs_c
            tail = tl.load(COUNT + pooled, mask=c_ok, other=0.0) - read_n.to(tl.float32)
            has_tail = c_ok & (tail > 0.5)
            n_tail = tl.where(has_tail, tail, 1.0)
            tile = pooled[:, None] * D + offs_d[None, :]
            key_sum = tl.load(KSUM + tile, mask=c_ok[:, None] & d_ok[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(key_sum), input_precision="ieee")  # [BLOCK_G, CHUNK_C]: q·Σk_b
            ell = (qk * scale - read_z) / n_tail[None, :] + tl.log(n_tail)[None, :]  # ℓ_b
            ell = tl.where(g_ok[:, None] & has_tail[None, :], ell, float("-inf"))
            tl.store(LOG_G + (p * G + offs_g[:, None]) * C + offs_c[None, :], ell - tl.log(n_tail)[None, :],
                     mask=g_ok[:, None] & c_ok[None, :])
            value_sum = tl.load(VSUM + tile, mask=c_ok[:, None] & d_ok[None, :], other=0.0)
            m_new = tl.maximum(m, tl.max(ell, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            e = tl.exp(ell - m_safe[:, None])  # 0 for clusters without a tail
            acc = acc * alpha[:, None] + tl.dot(e / n_tail[None, :], value_sum, input_precision="ieee")
            den = den * alpha + tl.sum(e, axis=1)
            m = m_new
            used += tl.sum(has_tail.to(tl.int32), axis=0)
        out = (p * PARTS + PARTS - PROGRAMS + part) * G + offs_g
        tl.store(M_OUT + out, m, mask=g_ok)
        tl.store(L_OUT + out, den, mask=g_ok)
        tl.store(ACC_OUT + out[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(USED_OUT + p * PARTS + PARTS - PROGRAMS + part, used)

    @triton.jit
    def _weighted_values(Z, IDX, RUNS, V, LOG_G, M_OUT, L_OUT, ACC_OUT, USED_OUT,
                         sv_b, sv_h, sv_n, ROWS, Hkv, Gs, T, KSEL, C, PER_SPLIT, PARTS,
                         G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, PROXY: tl.constexpr, HALF: tl.constexpr):
        """Program (p, split): Σ w_i v_i and Σ e^{z_i} over its columns, in its own max-subtracted softmax. A row of
        cluster b's run weighs w_i = e^{z_i} − g_b: the proxy's numerator Σ_b g_b (Σv_b − Σ_{X∩b} v_i) is then
        complete without summing the rows read per cluster."""
        p = tl.program_id(0) % ROWS
        split = tl.program_id(0) // ROWS
        b, h, s, t = _row(p, Hkv, Gs, T)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_c = tl.arange(0, BLOCK_C)
        g_ok = offs_g < G
        d_ok = offs_d < D
        if PROXY:  # the runs' ends: a column's cluster is the number of ends at or before it
            ends = tl.load(RUNS + p * (C + 1) + 1 + offs_c, mask=offs_c < C, other=2147483647)
            first = tl.load(RUNS + p * (C + 1))
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(split * PER_SPLIT, tl.minimum((split + 1) * PER_SPLIT, KSEL), BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            in_row = offs_k < KSEL
            idx = tl.load(IDX + p * KSEL + offs_k, mask=in_row, other=-1)
            valid = idx >= 0
            both = valid[None, :] & g_ok[:, None]
            z = tl.load(Z + (p * G + offs_g[:, None]) * KSEL + offs_k[None, :], mask=both, other=float("-inf"))
            v = tl.load(V + b * sv_b + h * sv_h + tl.where(valid, idx, 0)[:, None] * sv_n + offs_d[None, :],
                        mask=valid[:, None] & d_ok[None, :], other=0.0)
            top = tl.max(z, axis=1)
            if PROXY:
                cluster = tl.sum((ends[None, :] <= offs_k[:, None]).to(tl.int32), axis=1)
                in_cluster = valid & (offs_k >= first) & (cluster < C)
                log_g = tl.load(LOG_G + (p * G + offs_g[:, None]) * C + cluster[None, :],
                                mask=g_ok[:, None] & in_cluster[None, :], other=float("-inf"))
                top = tl.maximum(top, tl.max(log_g, axis=1))  # keeps e^{ln g_b − m} ≤ 1
            m_new = tl.maximum(m, top)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            e = tl.where(both, tl.exp(z - m_safe[:, None]), 0.0)
            w = e
            if PROXY:
                w = e - tl.exp(log_g - m_safe[:, None])
            if HALF:  # weights rounded to the values' 16-bit type for the tensor-core dot
                acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(w, v.to(tl.float32), input_precision="ieee")
            den = den * alpha + tl.sum(e, axis=1)
            m = m_new
        out = (p * PARTS + split) * G + offs_g
        tl.store(M_OUT + out, m, mask=g_ok)
        tl.store(L_OUT + out, den, mask=g_ok)
        tl.store(ACC_OUT + out[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(USED_OUT + p * PARTS + split, 0)

    @triton.jit
    def _merge(M_IN, L_IN, ACC_IN, USED_IN, OUT, USED, Hkv, Gs, T, PARTS,
               G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_PARTS: tl.constexpr):
        """The parts' numerators and denominators rescaled to one max and summed, divided, written in the query's
        layout and dtype; the proxies used, summed."""
        p = tl.program_id(0)
        b, h, s, t = _row(p, Hkv, Gs, T)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_p = tl.arange(0, BLOCK_PARTS)
        g_ok = offs_g < G
        both = g_ok[:, None] & (offs_d[None, :] < D)
        top = tl.max(tl.load(M_IN + (p * PARTS + offs_p[:, None]) * G + offs_g[None, :],
                             mask=(offs_p[:, None] < PARTS) & g_ok[None, :], other=float("-inf")), axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        den = tl.zeros([BLOCK_G], tl.float32)
        numerator = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for part in range(0, PARTS):
            rows = (p * PARTS + part) * G + offs_g
            w = tl.exp(tl.load(M_IN + rows, mask=g_ok, other=float("-inf")) - top)  # 0 for a part that read nothing
            den += w * tl.load(L_IN + rows, mask=g_ok, other=0.0)
            numerator += w[:, None] * tl.load(ACC_IN + rows[:, None] * D + offs_d[None, :], mask=both, other=0.0)
        head = h * (G * Gs) + s * G + offs_g
        out = numerator / tl.where(g_ok, den, 1.0)[:, None]  # padding lanes: no 0/0
        tl.store(OUT + ((b * (Hkv * G * Gs) + head[:, None]) * T + t) * D + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=both)
        tl.store(USED + p, tl.sum(tl.load(USED_IN + p * PARTS + offs_p, mask=offs_p < PARTS, other=0), axis=0))


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(int(n)))


def cluster_runs(selection: Selection, assignment: Tensor, num_clusters: int) -> Selection:
    """A selection regrouped by cluster, with its ``runs``: each row's index stably sorted by the cluster of its
    positions (rows outside every cluster and padding last), for a selection that does not say how it is laid out."""
    B, Hkv = assignment.shape[:2]
    index = selection.index
    cluster = assignment.gather(-1, index.clamp_min(0).reshape(B, Hkv, -1)).reshape(index.shape)
    cluster = cluster.masked_fill(index < 0, num_clusters)
    cluster, order = cluster.sort(dim=-1, stable=True)
    bounds = torch.arange(num_clusters + 1, device=index.device).expand(*index.shape[:-1], -1).contiguous()
    runs = torch.searchsorted(cluster.contiguous(), bounds).to(torch.int32)
    return Selection(index.gather(-1, order), selection.log_weight.gather(-1, order), runs)


class FlashKernel(Kernel):
    """OpenAttention.flash: Triton decode kernels over the exact rows and one proxy per cluster."""

    name = "flash"
    priority = 10  # ``kernel: auto`` takes it wherever it runs: on CUDA
    block_k = 64  # index columns per block of the logits and value passes
    clusters_per_chunk: int | None = None  # clusters per tile of the proxy pass (a power of two ≥ 16); None: 16
    chunks_per_program: int | None = None  # tiles per program of the proxy pass; None: enough programs (~512)
    poison = False  # fill the output buffers with NaN before launching (tests: every element must be written)

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.note = ""

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if triton is None:
            return "triton is not installed"
        return None if device.type == "cuda" else "no CUDA device"

    def attend(self, query: Tensor, keys: Tensor, values: Tensor, selection: Selection | None,
               proxies: PooledClusters | None, scale: float) -> tuple[Tensor, Tensor | None]:
        reason = triton_path.unavailable_reason(query.device)
        if reason is not None:
            self.note = f"torch reference: {reason}"
            return TorchKernel().attend(query, keys, values, selection, proxies, scale)
        if selection is None:  # dense: the fused SDPA of torch
            self.note = "dense: torch SDPA"
            out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scale,
                                                                   enable_gqa=keys.shape[1] != query.shape[1])
            return out, None
        self.note = "triton" + (" (interpreter)" if triton_path.interpreting() else "")
        return self._sparse(query, keys, values, selection, proxies, scale)

    def static_step(self, state):
        """``flash_step.FusedStep``: the whole step in nine launches, where the pipeline's other components are the
        defaults (QGC, QGS, ErrorGate) and the state's device runs Triton; else None."""
        from oa_plugins.kernels.flash_step import FusedStep, fused_unsupported

        return FusedStep(state) if fused_unsupported(state) is None else None

    def _sparse(self, query, keys, values, selection, proxies, scale):
        B, Hq, T, D = query.shape
        Hkv = keys.shape[1]
        Gs = selection.index.shape[2]
        G = Hq // Hkv // Gs  # query heads served by each selection
        P = B * Hkv * Gs * T
        device = query.device
        if query.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
            query, keys, values = query.contiguous(), keys.contiguous(), values.contiguous()
        proxy = proxies is not None
        C = proxies.count.shape[-1] if proxy else 0
        if proxy and selection.runs is None:
            selection = cluster_runs(selection, proxies.assignment, C)
        ksel = selection.index.shape[-1]
        index = selection.index.reshape(P, ksel).contiguous()
        log_weight = selection.log_weight.float().reshape(P, ksel).contiguous()
        if proxy:
            runs = selection.runs.to(torch.int32).reshape(P, C + 1).contiguous()
            key_sum, value_sum = proxies.key_sum.float().contiguous(), proxies.value_sum.float().contiguous()
            count = proxies.count.float().contiguous()
        else:
            runs = key_sum = value_sum = count = log_weight  # unused placeholders

        block_k, block_g, block_d = self.block_k, _pow2(G), _pow2(D)
        blocks = max(1, triton.cdiv(ksel, block_k))
        # Splits of the value pass: about 2048 programs (to hide the gathers' latency), each at least one block.
        splits = max(1, min(blocks, triton.cdiv(2048, P)))
        per_split = triton.cdiv(blocks, splits) * block_k
        splits = max(1, triton.cdiv(ksel, per_split))
        chunk_c = self.clusters_per_chunk or 16
        chunks = triton.cdiv(max(C, 1), chunk_c)
        # Programs of the proxy pass: at least ~512 in all where the row's tiles allow (a small batch has few rows).
        per_program = chunk_c * (self.chunks_per_program or triton.cdiv(chunks, min(chunks, triton.cdiv(512, P))))
        programs = triton.cdiv(C, per_program) if proxy else 0
        parts = splits + programs  # the value pass's splits, then the proxies' parts

        def empty(*shape, dtype=torch.float32):  # buffers every element of which the kernels write
            if self.poison:
                return torch.full(shape, -1 if dtype == torch.int32 else math.nan, dtype=dtype, device=device)
            return torch.empty(shape, dtype=dtype, device=device)

        logits = empty(P, G, max(ksel, 1))
        row_max, den, acc = empty(P, parts, G), empty(P, parts, G), empty(P, parts, G, D)
        used_parts = empty(P, parts, dtype=torch.int32)
        log_g = empty(P, G, max(C, 1))
        # 16-bit inputs use tensor-core dots. Triton's CPU interpreter (3.9) gets bf16 dots wrong, so there bf16 is
        # upcast first; the device benchmark checks the bf16 dots against the reference at the target shapes.
        half = triton_path.tensor_core_dots(query.dtype)
        _exact_logits[(P * blocks,)](
            query, keys, index, log_weight, logits,
            query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
            P, Hkv, Gs, T, ksel, scale, G=G, BLOCK_G=block_g, BLOCK_K=block_k, D=D, BLOCK_D=block_d, HALF=half)
        if proxy:
            _proxies[(P * programs,)](
                logits, index, log_weight, runs, query, key_sum, value_sum, count, log_g, row_max, den, acc,
                used_parts, query.stride(0), query.stride(1), query.stride(2), P, Hkv, Gs, T, ksel, C, per_program,
                programs, parts, scale, G=G, BLOCK_G=block_g, BLOCK_K=block_k, CHUNK_C=chunk_c, D=D,
                BLOCK_D=block_d)
        _weighted_values[(P * splits,)](
            logits, index, runs, values, log_g, row_max, den, acc, used_parts,
            values.stride(0), values.stride(1), values.stride(2), P, Hkv, Gs, T, ksel, max(C, 1), per_split,
            parts, G=G, BLOCK_G=block_g, BLOCK_K=block_k, BLOCK_C=_pow2(max(C, 1)), D=D, BLOCK_D=block_d,
            PROXY=proxy, HALF=half)
        out = empty(B, Hq, T, D, dtype=query.dtype)
        used = empty(P, dtype=torch.int32)
        _merge[(P,)](row_max, den, acc, used_parts, out, used, Hkv, Gs, T, parts,
                     G=G, BLOCK_G=block_g, D=D, BLOCK_D=block_d, BLOCK_PARTS=_pow2(parts, 2))
        return out, used.view(B, Hkv, Gs, T) if proxy else None


@hookimpl
def register_kernels(register):
    if triton is not None:
        register(FlashKernel)
