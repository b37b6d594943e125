"""QGS — Query-Geometry Selector (OpenAttention paper, §3.2, Eq. 5).

Scores every key from int8 codes of its projection on the query subspace: c_i = Q8(U_rᵀk_i) with a per-key scale,
z̃_i = s·(U_rᵀq)·c_i. It reads r bytes per key instead of 2D, and U_r is the basis QGC already computed when the two
are used together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from oa_core import hookimpl
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
        B, Hq, T, D = query.shape
        Hkv = index.basis.shape[1]
        q = query.float().reshape(B, Hkv, Hq // Hkv * T, D) @ index.basis  # [B, Hkv, g·T, r]
        if q.is_cuda and triton is not None:
            return int8_scores(q, index.codes, index.scales, scale).view(B, Hq, T, -1)
        scores = (q @ index.codes.float().transpose(-1, -2)) * (scale * index.scales[:, :, None, :])
        return scores.view(B, Hq, T, -1)


def int8_scores(projected: Tensor, codes: Tensor, scales: Tensor, scale: float) -> Tensor:
    """s·(U_rᵀq)·c_i·scale_i straight from the int8 codes (one read of r bytes per key): projected queries
    ``[B, Hkv, Q, r]``, codes ``[B, Hkv, N, r]`` int8, scales ``[B, Hkv, N]`` → ``[B, Hkv, Q, N]`` float32."""
    B, Hkv, Q, r = projected.shape
    N = codes.shape[2]
    out = torch.empty(B, Hkv, Q, N, device=projected.device)
    block_n = 128
    _int8_scores[(B * Hkv, triton.cdiv(N, block_n))](
        projected.contiguous(), codes.contiguous(), scales.float().contiguous(), out, N, Q, r, scale,
        BLOCK_Q=max(16, triton.next_power_of_2(Q)), BLOCK_R=max(16, triton.next_power_of_2(r)), BLOCK_N=block_n)
    return out


if triton is not None:

    @triton.jit
    def _int8_scores(QP, CODES, SCALES, OUT, N, Q, R, scale,
                     BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        head = tl.program_id(0).to(tl.int64)  # (batch row, KV head)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_r = tl.arange(0, BLOCK_R)
        q = tl.load(QP + (head * Q + offs_q[:, None]) * R + offs_r[None, :],
                    mask=(offs_q[:, None] < Q) & (offs_r[None, :] < R), other=0.0)
        codes = tl.load(CODES + (head * N + offs_n[:, None]) * R + offs_r[None, :],
                        mask=(offs_n[:, None] < N) & (offs_r[None, :] < R), other=0).to(tl.float32)
        row_scale = tl.load(SCALES + head * N + offs_n, mask=offs_n < N, other=0.0)
        scores = tl.dot(q, tl.trans(codes), input_precision="ieee") * (scale * row_scale)[None, :]
        tl.store(OUT + (head * Q + offs_q[:, None]) * N + offs_n[None, :], scores,
                 mask=(offs_q[:, None] < Q) & (offs_n[None, :] < N))


@hookimpl
def register_selectors(register):
    register(QuerySubspaceSelector)
