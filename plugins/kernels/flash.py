"""OpenAttention.flash — Triton decode kernels for DESIGN.md §1 step 7.

Per selection row p (a batch row, KV head, selection head and query) the exact rows X_p are read by index and the G
query heads that share the selection (the whole GQA group with ``gqa: shared``, one head otherwise) are served by
each row read. Four kernels; each KV byte is read once:

1. ``_exact_logits`` (split over X_p): keys of X_p → z_i = s·q·k_i + ln η_i (float32, a K-wide buffer per head).
2. ``_proxies`` (one program per row): reduces the row's z per cluster (one-hot dots: Σ_{X∩b} z_i and |X∩b|) and
   forms every proxy from the pooled sums minus the rows read, without reading a key again: n_T = n_b − |X∩b|,
   ℓ_b = (s·q·Σk_b − Σ_{X∩b} z_i)/n_T + ln n_T; the row's maximum m over {z_i} ∪ {ℓ_b}; each proxy's per-token
   weight g_b e^{−m} (g_b = e^{ℓ_b}/n_T); and the proxies' numerator Σ_b g_b e^{−m} Σv_b and denominator.
3. ``_weighted_values`` (split over X_p, flash-decoding style): reads the values of its slice once. The proxy
   numerator Σ_b e^{ℓ_b} v̄_T = Σ_b g_b Σv_b − Σ_{i∈X} g_{c(i)} v_i folds into the row weights
   e^{z_i − m} − g_{c(i)} e^{−m}. Every split shares m, so the merge is a plain sum of numerators and denominators.
4. ``_merge``: that sum, plus the proxies' terms, divided and written in the query's layout and dtype.

Inputs may be float32, float16 or bfloat16; accumulation is float32. 16-bit inputs use tensor-core dots for q·k and
w·v; everything else (and float32 inputs throughout) uses ``ieee`` float32 dots, no TF32.
Where there is no CUDA device (and no ``TRITON_INTERPRET=1``) or no Triton, ``attend`` runs the torch reference and
says why in ``note``.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Kernel, PooledClusters, Selection
from oa_plugins.kernels.reference import TorchKernel

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton path can't run on tensors of ``device`` (None: it can)."""
    if triton is None:
        return "triton is not installed"
    if device.type == "cuda" or (_interpreting() and device.type == "cpu"):
        return None
    return f"no CUDA device for tensors on {device} (set TRITON_INTERPRET=1 to run the kernels on the CPU)"


if triton is not None:

    @triton.jit
    def _row(p, Hkv, Gs, T):
        """Selection row p → (batch row as int64 — a batch of long caches passes 2^31 elements —, KV head,
        selection head, query)."""
        return (p // (T * Gs * Hkv)).to(tl.int64), (p // (T * Gs)) % Hkv, (p // T) % Gs, p % T

    @triton.jit
    def _exact_logits(Q, K, IDX, LW, Z,
                      sq_b, sq_h, sq_t, sk_b, sk_h, sk_n,
                      Hkv, Gs, T, KSEL, scale,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr):
        p = tl.program_id(0)
        block = tl.program_id(1)
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
    def _proxies(Z, IDX, LW, ASSIGN, Q, KSUM, VSUM, COUNT, M, PER_TOKEN, NUM, DEN, USED,
                 sq_b, sq_h, sq_t, sa_b, sa_h,
                 Hkv, Gs, T, KSEL, C, scale,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, PROXY: tl.constexpr):
        p = tl.program_id(0)
        b, h, s, t = _row(p, Hkv, Gs, T)
        offs_g = tl.arange(0, BLOCK_G)
        offs_c = tl.arange(0, BLOCK_C)
        g_ok = offs_g < G
        c_ok = offs_c < C

        z_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        read_z = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
        read_n = tl.zeros([BLOCK_C], tl.float32)
        for start in range(0, KSEL, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            in_row = offs_k < KSEL
            z = tl.load(Z + (p * G + offs_g[:, None]) * KSEL + offs_k[None, :],
                        mask=g_ok[:, None] & in_row[None, :], other=float("-inf"))
            z_max = tl.maximum(z_max, tl.max(z, axis=1))
            if PROXY:
                idx = tl.load(IDX + p * KSEL + offs_k, mask=in_row, other=-1)
                valid = idx >= 0
                cluster = tl.load(ASSIGN + b * sa_b + h * sa_h + tl.where(valid, idx, 0), mask=valid, other=C)
                onehot = (cluster[:, None] == offs_c[None, :]).to(tl.float32)  # [BLOCK_K, BLOCK_C]
                lw = tl.load(LW + p * KSEL + offs_k, mask=in_row, other=0.0)
                raw = tl.where(valid[None, :] & g_ok[:, None], z - lw[None, :], 0.0)
                read_z += tl.dot(raw, onehot, input_precision="ieee")
                read_n += tl.sum(onehot, axis=0)
        m = z_max
        if PROXY:
            head = h * (G * Gs) + s * G + offs_g
            pooled = (b * Hkv + h) * C
            # s·q·Σk_b, over the head dim in chunks (a [C, D] float32 tile at once would crowd the registers).
            q_sum = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                q = tl.load(Q + b * sq_b + head[:, None] * sq_h + t * sq_t + offs_d[None, :],
                            mask=g_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
                key_sum = tl.load(KSUM + (pooled + offs_c[:, None]) * D + offs_d[None, :],
                                  mask=c_ok[:, None] & (offs_d[None, :] < D), other=0.0)
                q_sum += tl.dot(q, tl.trans(key_sum), input_precision="ieee")
            count = tl.load(COUNT + pooled + offs_c, mask=c_ok, other=0.0)
            tail = count - read_n
            has_tail = (tail > 0.5) & c_ok
            n_tail = tl.where(has_tail, tail, 1.0)
            proxy = tl.where(has_tail[None, :], (scale * q_sum - read_z) / n_tail[None, :] + tl.log(n_tail)[None, :],
                             float("-inf"))  # ℓ_b
            m = tl.maximum(m, tl.max(proxy, axis=1))
        m = tl.where(m == float("-inf"), 0.0, m)  # a row with nothing to read
        tl.store(M + p * G + offs_g, m, mask=g_ok)
        if PROXY:
            weight = tl.where(has_tail[None, :], tl.exp(proxy - m[:, None]), 0.0)  # e^{ℓ_b − m}
            per_token = weight / n_tail[None, :]  # g_b e^{−m}
            tl.store(PER_TOKEN + (p * G + offs_g[:, None]) * C + offs_c[None, :], per_token,
                     mask=g_ok[:, None] & c_ok[None, :])
            tl.store(DEN + p * G + offs_g, tl.sum(weight, axis=1), mask=g_ok)
            tl.store(USED + p, tl.sum(has_tail.to(tl.int32), axis=0))
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                value_sum = tl.load(VSUM + (pooled + offs_c[:, None]) * D + offs_d[None, :],
                                    mask=c_ok[:, None] & (offs_d[None, :] < D), other=0.0)
                tl.store(NUM + (p * G + offs_g[:, None]) * D + offs_d[None, :],
                         tl.dot(per_token, value_sum, input_precision="ieee"),
                         mask=g_ok[:, None] & (offs_d[None, :] < D))

    @triton.jit
    def _weighted_values(Z, IDX, ASSIGN, V, M, PER_TOKEN, ACC, DEN,
                         sv_b, sv_h, sv_n, sa_b, sa_h,
                         Hkv, Gs, T, KSEL, C, SPLITS, PER_SPLIT,
                         G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, PROXY: tl.constexpr, HALF: tl.constexpr):
        p = tl.program_id(0)
        split = tl.program_id(1)
        b, h, s, t = _row(p, Hkv, Gs, T)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        d_ok = offs_d < D
        m = tl.load(M + p * G + offs_g, mask=g_ok, other=0.0)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        for start in range(split * PER_SPLIT, tl.minimum((split + 1) * PER_SPLIT, KSEL), BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            in_row = offs_k < KSEL
            idx = tl.load(IDX + p * KSEL + offs_k, mask=in_row, other=-1)
            valid = idx >= 0
            both = valid[None, :] & g_ok[:, None]
            z = tl.load(Z + (p * G + offs_g[:, None]) * KSEL + offs_k[None, :], mask=both, other=float("-inf"))
            e = tl.where(both, tl.exp(z - m[:, None]), 0.0)
            den += tl.sum(e, axis=1)
            w = e
            if PROXY:  # minus the proxy's per-token weight of the row's cluster (C: none)
                cluster = tl.load(ASSIGN + b * sa_b + h * sa_h + tl.where(valid, idx, 0), mask=valid, other=C)
                in_cluster = both & (cluster < C)[None, :]
                w = e - tl.load(PER_TOKEN + (p * G + offs_g[:, None]) * C + cluster[None, :], mask=in_cluster,
                                other=0.0)
            v = tl.load(V + b * sv_b + h * sv_h + tl.where(valid, idx, 0)[:, None] * sv_n + offs_d[None, :],
                        mask=valid[:, None] & d_ok[None, :], other=0.0)
            if HALF:  # weights rounded to the values' 16-bit type for the tensor-core dot
                acc += tl.dot(w.to(v.dtype), v)
            else:
                acc += tl.dot(w, v.to(tl.float32), input_precision="ieee")
        out = (p * SPLITS + split) * G + offs_g
        tl.store(ACC + out[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(DEN + out, den, mask=g_ok)


if triton is not None:

    @triton.jit
    def _merge(ACC, DEN, NUM, PDEN, OUT, Hkv, Gs, T, SPLITS,
               G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PROXY: tl.constexpr):
        """Σ over splits (+ the proxies) of numerators and denominators, divided, written in the query's layout and
        dtype."""
        p = tl.program_id(0)
        b, h, s, t = _row(p, Hkv, Gs, T)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        both = (offs_g[:, None] < G) & (offs_d[None, :] < D)
        numerator = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        denominator = tl.zeros([BLOCK_G], tl.float32)
        for split in range(0, SPLITS):
            rows = (p * SPLITS + split) * G + offs_g
            numerator += tl.load(ACC + rows[:, None] * D + offs_d[None, :], mask=both, other=0.0)
            denominator += tl.load(DEN + rows, mask=offs_g < G, other=0.0)
        if PROXY:
            numerator += tl.load(NUM + (p * G + offs_g[:, None]) * D + offs_d[None, :], mask=both, other=0.0)
            denominator += tl.load(PDEN + p * G + offs_g, mask=offs_g < G, other=1.0)
        head = h * (G * Gs) + s * G + offs_g
        out = numerator / tl.where(offs_g < G, denominator, 1.0)[:, None]  # padding lanes: no 0/0
        tl.store(OUT + ((b * (Hkv * G * Gs) + head[:, None]) * T + t) * D + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=both)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(int(n)))


class FlashKernel(Kernel):
    """OpenAttention.flash: Triton decode kernels over the exact rows and one proxy per cluster."""

    name = "flash"
    block_k = 64
    poison = False  # fill the output buffers with NaN before launching (tests: every element must be written)

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.note = ""

    def attend(self, query: Tensor, keys: Tensor, values: Tensor, selection: Selection | None,
               proxies: PooledClusters | None, scale: float) -> tuple[Tensor, Tensor | None]:
        reason = unavailable_reason(query.device)
        if reason is not None:
            self.note = f"torch reference: {reason}"
            return TorchKernel().attend(query, keys, values, selection, proxies, scale)
        if selection is None:  # dense: the fused SDPA of torch
            self.note = "dense: torch SDPA"
            out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scale,
                                                                   enable_gqa=keys.shape[1] != query.shape[1])
            return out, None
        self.note = "triton" + (" (interpreter)" if _interpreting() else "")
        return self._sparse(query, keys, values, selection, proxies, scale)

    def _sparse(self, query, keys, values, selection, proxies, scale):
        B, Hq, T, D = query.shape
        Hkv = keys.shape[1]
        Gs = selection.index.shape[2]
        G = Hq // Hkv // Gs  # query heads served by each selection
        ksel = selection.index.shape[-1]
        P = B * Hkv * Gs * T
        device = query.device
        if query.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
            query, keys, values = query.contiguous(), keys.contiguous(), values.contiguous()
        index = selection.index.reshape(P, ksel).contiguous()
        log_weight = selection.log_weight.float().reshape(P, ksel).contiguous()

        def empty(*shape):  # float32 buffers every element of which the kernels write
            return torch.full(shape, math.nan, device=device) if self.poison else torch.empty(shape, device=device)

        logits = empty(P, G, max(ksel, 1))
        block_k, block_g, block_d = self.block_k, _pow2(G), _pow2(D)
        # 16-bit inputs use tensor-core dots. Triton's CPU interpreter (3.9) gets bf16 dots wrong, so there bf16 is
        # upcast first; the device benchmark checks the bf16 dots against the reference at the target shapes.
        half = query.dtype == torch.float16 or (query.dtype == torch.bfloat16 and not _interpreting())
        if ksel:
            _exact_logits[(P, triton.cdiv(ksel, block_k))](
                query, keys, index, log_weight, logits,
                query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
                Hkv, Gs, T, ksel, scale, G=G, BLOCK_G=block_g, BLOCK_K=block_k, D=D, BLOCK_D=block_d, HALF=half)

        proxy = proxies is not None
        C = proxies.count.shape[-1] if proxy else 0
        if proxy:
            assignment = proxies.assignment
            key_sum, value_sum = proxies.key_sum.float().contiguous(), proxies.value_sum.float().contiguous()
            count = proxies.count.float().contiguous()
        else:
            assignment = key_sum = value_sum = count = logits  # unused placeholders
        row_max, per_token = empty(P, G), empty(P, G, max(C, 1))
        proxy_num, proxy_den = (empty(P, G, D), empty(P, G)) if proxy else (None, None)
        used = torch.zeros(P, device=device, dtype=torch.int32)
        sa = (assignment.stride(0), assignment.stride(1)) if proxy else (0, 0)
        _proxies[(P,)](
            logits, index, log_weight, assignment, query, key_sum, value_sum, count, row_max, per_token,
            proxy_num if proxy else logits, proxy_den if proxy else logits, used,
            query.stride(0), query.stride(1), query.stride(2), *sa, Hkv, Gs, T, ksel, C, scale,
            G=G, BLOCK_G=block_g, BLOCK_K=block_k, BLOCK_C=_pow2(max(C, 1)), D=D, BLOCK_D=min(block_d, 64),
            PROXY=proxy)
        # Splits: about 1024 programs (several per SM, to hide the gathers' latency), each at least one block of rows.
        blocks = max(1, triton.cdiv(ksel, block_k))
        splits = max(1, min(blocks, triton.cdiv(1024, P)))
        per_split = triton.cdiv(blocks, splits) * block_k
        splits = max(1, triton.cdiv(max(ksel, 1), per_split))
        acc, den = empty(P, splits, G, D), empty(P, splits, G)
        _weighted_values[(P, splits)](
            logits, index, assignment, values, row_max, per_token, acc, den,
            values.stride(0), values.stride(1), values.stride(2), *sa, Hkv, Gs, T, ksel, C, splits, per_split,
            G=G, BLOCK_G=block_g, BLOCK_K=block_k, D=D, BLOCK_D=block_d, PROXY=proxy, HALF=half)
        out = torch.empty(B, Hq, T, D, device=device, dtype=query.dtype)
        if self.poison:
            out.fill_(math.nan)
        _merge[(P,)](acc, den, proxy_num if proxy else acc, proxy_den if proxy else den, out, Hkv, Gs, T, splits,
                     G=G, BLOCK_G=block_g, D=D, BLOCK_D=block_d, PROXY=proxy)
        return out, used.view(B, Hkv, Gs, T) if proxy else None


@hookimpl
def register_kernels(register):
    if triton is not None:
        register(FlashKernel)
