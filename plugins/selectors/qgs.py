"""QGS — Query-Geometry Selector (OpenAttention paper, §3.2, Eq. 5).

Scores every key from int8 codes of its projection on the query subspace: c_i = Q8(U_rᵀk_i) with a per-key scale,
z̃_i = s·(U_rᵀq)·c_i. It reads r bytes per key instead of 2D, and U_r is the basis QGC already computed when the two
are used together.

``group_scores`` runs one Triton kernel on CUDA tensors (and on CPU tensors under ``TRITON_INTERPRET=1``): it reads
each key's codes and scale once and writes the group's maximum (or each head's score) with -inf outside the clusters,
straight into the ``[B, Hkv, Gs, T, N]`` float32 output. Elsewhere it is the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from oa_core import hookimpl, triton_path
from oa_core.components import Clusters, Selector
from oa_plugins.clusterers.qgc import query_geometry

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


class QGSConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=16, ge=1, description="r: code bytes per key")
    query_window: int = Field(default=256, ge=1, description="prefill queries that estimate the basis, "
                                                             "when the clusterer provides none")


@dataclass
class QGSIndex:
    basis: Tensor  # U_r, [B, Hkv, D, r] float32
    codes: Tensor  # [B, Hkv, N, r] int8
    scales: Tensor  # [B, Hkv, N] float32


def quantize(projected: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: ``[..., r]`` → (codes int8 ``[..., r]``, scales ``[...]``)."""
    scales = projected.abs().amax(-1).clamp_min(1e-12) / 127.0
    return torch.round(projected / scales[..., None]).to(torch.int8), scales


class QuerySubspaceSelector(Selector):
    """QGS: int8 codes of keys projected on the query subspace (paper Eq. 5)."""

    name = "qgs"
    Config = QGSConfig

    def build(self, keys: Tensor, queries: Tensor | None, clusters: Clusters,
              generator: torch.Generator | None = None) -> QGSIndex:
        rank = self.config.rank
        if clusters.basis is not None and clusters.basis.shape[-1] >= rank:
            basis = clusters.basis[..., :rank]
        else:
            basis, _ = query_geometry(keys, queries, clusters.assignment[:, 0] < clusters.num_clusters, rank,
                                      self.config.query_window)
        codes, scales = quantize(keys.float() @ basis)
        return QGSIndex(basis, codes, scales)

    def extend(self, index: QGSIndex, keys: Tensor) -> QGSIndex:
        codes, scales = quantize(keys.float() @ index.basis)
        return QGSIndex(index.basis, torch.cat([index.codes, codes], 2), torch.cat([index.scales, scales], 2))

    def score(self, query: Tensor, index: QGSIndex, keys: Tensor, scale: float) -> Tensor:
        B, Hq, T, _ = query.shape
        q = _project(query, index)
        if triton_path.unavailable_reason(query.device) is None:  # every head its own: a group of 1
            return group_int8_scores(q, index.codes, index.scales, scale, T, 1).view(B, Hq, T, -1)
        scores = (q @ index.codes.float().transpose(-1, -2)) * (scale * index.scales[:, :, None, :])
        return scores.view(B, Hq, T, -1)

    def group_scores(self, query: Tensor, index: QGSIndex, keys: Tensor, scale: float, shared: bool,
                     outside: Tensor | None = None) -> Tensor:
        # The fused kernel takes the group maximum before the positive factor s·scale_i (scales are > 0 by
        # construction); a non-positive s goes to the reference, which reduces after scaling.
        if not (triton_path.unavailable_reason(query.device) is None and scale > 0):
            return super().group_scores(query, index, keys, scale, shared, outside)
        T = query.shape[2]
        g = query.shape[1] // index.basis.shape[1]
        return group_int8_scores(_project(query, index), index.codes, index.scales, scale, T, g if shared else 1,
                                 outside)


def _project(query: Tensor, index: QGSIndex) -> Tensor:
    """U_rᵀq: ``[B, Hq, T, D]`` → ``[B, Hkv, g·T, r]`` float32, rows (head in the KV group, query)."""
    B, Hq, T, D = query.shape
    Hkv = index.basis.shape[1]
    return query.float().reshape(B, Hkv, Hq // Hkv * T, D) @ index.basis


def group_int8_scores(projected: Tensor, codes: Tensor, scales: Tensor, scale: float, queries: int, group: int,
                      outside: Tensor | None = None, *, block_n: int | None = None,
                      num_warps: int = 4) -> Tensor:
    """The selection scores in one pass over the int8 codes: projected queries ``[B, Hkv, g·T, r]`` (rows ordered
    (head in the KV group, query), T = ``queries``), codes ``[B, Hkv, N, r]`` int8, scales ``[B, Hkv, N]`` (> 0),
    ``scale`` s > 0; ``group``: the heads that share one selection (g: ``gqa: shared``, 1: per head) →
    ``[B, Hkv, Gs, T, N]`` float32 (Gs = g/group): s·scale_i·max over the selection head's group of (U_rᵀq)·c_i,
    -inf where ``outside`` (bool, broadcastable to the output) is True. ``block_n``: tokens per program (default
    512, fewer for short rows). Launches one kernel and waits for nothing (CUDA-graph capturable)."""
    B, Hkv, Q, r = projected.shape
    N = codes.shape[2]
    T = queries
    Gs = Q // (group * T)
    if Gs * group * T != Q:
        raise ValueError(f"projected queries: {Q} rows is not a multiple of group {group} × queries {T}")
    out = torch.empty(B, Hkv, Gs, T, N, device=projected.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if block_n is None:
        block_n = min(512, max(16, triton.next_power_of_2(N)))
    if outside is not None:
        mask = torch.broadcast_to(outside.to(torch.bool), out.shape).view(torch.uint8)  # strides 0 where broadcast
        strides = mask.stride()
    else:
        mask, strides = out, (0, 0, 0, 0, 0)  # never read
    num_blocks = triton.cdiv(N, block_n)
    _group_int8_scores[(B * Hkv * num_blocks,)](
        projected.contiguous(), codes.contiguous(), scales.float().contiguous(), mask, out,
        N, Hkv, T, Gs * T, num_blocks, scale, *strides,
        G=group, HAS_OUTSIDE=outside is not None, R=r, BLOCK_R=triton.next_power_of_2(r), BLOCK_N=block_n,
        num_warps=num_warps)
    return out


if triton is not None:

    @triton.jit
    def _group_int8_scores(QP, CODES, SCALES, OUTSIDE, OUT, N, Hkv, T, ROWS, num_blocks, scale,
                           so_b, so_h, so_s, so_t, so_n,
                           G: tl.constexpr, HAS_OUTSIDE: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_N: tl.constexpr):
        """One program per (batch row, KV head, block of BLOCK_N tokens): the block's codes stay in registers while
        each of the ROWS = Gs·T output rows (row = selection head · T + query) takes the maximum over its G query
        heads of a broadcast multiply-and-sum over r (no padded dot), times s·scale_i. R (the rank) is a constexpr:
        with R = BLOCK_R the r-mask folds away and each thread loads whole 16-byte code rows."""
        pid = tl.program_id(0)
        head = (pid // num_blocks).to(tl.int64)  # (batch row, KV head): B·Hkv·N may pass 2^31
        offs_n = (pid % num_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        in_n = offs_n < N
        codes = tl.load(CODES + (head * N + offs_n[:, None]) * R + offs_r[None, :],
                        mask=in_n[:, None] & (offs_r[None, :] < R), other=0).to(tl.float32)
        factor = scale * tl.load(SCALES + head * N + offs_n, mask=in_n, other=1.0)
        if HAS_OUTSIDE:
            mask_base = OUTSIDE + (head // Hkv) * so_b + (head % Hkv) * so_h + offs_n.to(tl.int64) * so_n
        for row in range(0, ROWS):
            s = (row // T).to(tl.int64)
            t = (row % T).to(tl.int64)
            best = tl.full([BLOCK_N], float("-inf"), tl.float32)
            for j in tl.static_range(G):
                q = tl.load(QP + (head * (ROWS * G) + (s * G + j) * T + t) * R + offs_r, mask=offs_r < R, other=0.0)
                best = tl.maximum(best, tl.sum(codes * q[None, :], axis=1))
            scores = best * factor
            if HAS_OUTSIDE:
                hidden = tl.load(mask_base + s * so_s + t * so_t, mask=in_n, other=0)
                scores = tl.where(hidden != 0, float("-inf"), scores)
            tl.store(OUT + (head * ROWS + row) * N + offs_n, scores, mask=in_n)


@hookimpl
def register_selectors(register):
    register(QuerySubspaceSelector)
