"""QGS — Query-Geometry Selector (OpenAttention paper, §3.2, Eq. 5).

Scores every key from int8 codes of its projection on the query subspace: c_i = Q8(U_rᵀk_i) with a per-key scale,
z̃_i = s·(U_rᵀq)·c_i. It reads r bytes per key instead of 2D. In the paper U_r is the top-r eigenbasis of the
prefill queries' second moment (``oa_core.ops.geometry.query_geometry``), the basis QGC clusters in. Here
``key_rank`` of its r columns (by default half) follow the clustered keys' spread outside the query subspace instead
(``geometry.with_key_spread``): keys that stand out where the context's queries do not look (README, "Gemma-3-270M,
and QGS's key spread").

On CUDA tensors (and on CPU tensors under ``TRITON_INTERPRET=1``) ``score`` is one Triton kernel: it reads each key's
codes and scale once and writes, per selection head, the maximum over its query heads straight into the
``[B, Hkv, Gs, T, N]`` float32 output. Elsewhere it is the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Clusters, Selector
from oa_core.ops import triton_path
from oa_core.ops.geometry import QUERY_WINDOW, check_rank, project, query_geometry, with_key_spread
from oa_core.ops.rerank import ExactRerank
from oa_core.ops.triton_path import tl, triton


class QGSConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=16, ge=1, description="r: code bytes per key")
    query_window: int = Field(default=QUERY_WINDOW, ge=1, description="last prefill queries that estimate the basis")
    rerank: float = Field(
        default=4.0,
        ge=0.0,
        description="shortlist re-ranked by exact logits, in multiples of the "
        "selectable budget (default 4; 0: the paper's QGS, no re-rank)",
    )
    key_rank: int | None = Field(
        default=None,
        ge=0,
        description="of the rank, dimensions along the keys' spread "
        "outside the query subspace (default: half the rank; 0: the query geometry alone, "
        "the paper's)",
    )

    @model_validator(mode="after")
    def _key_rank_below_rank(self) -> QGSConfig:
        if self.key_rank is None:
            self.key_rank = self.rank // 2
        elif self.key_rank >= self.rank:
            raise ValueError(
                f"key_rank ({self.key_rank}) must be below rank ({self.rank}): the query geometry keeps "
                "at least one dimension"
            )
        return self


@dataclass
class QGSIndex:
    basis: Tensor  # U_r, [B, Hkv, D, r] float32
    codes: Tensor  # [B, Hkv, N, r] int8
    scales: Tensor  # [B, Hkv, N] float32


def quantize(projected: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: ``[..., r]`` → (codes int8 ``[..., r]``, scales ``[...]``)."""
    scales = projected.abs().amax(-1).clamp_min(1e-12) / 127.0
    return torch.round(projected / scales[..., None]).to(torch.int8), scales


class QuerySubspaceSelector(ExactRerank, Selector):
    """QGS: int8 codes of keys projected on the query subspace (paper Eq. 5)."""

    name = "qgs"
    Config = QGSConfig
    config: QGSConfig

    def build(
        self, keys: Tensor, queries: Tensor | None, clusters: Clusters, generator: torch.Generator | None = None
    ) -> QGSIndex:
        region = clusters.assignment[:, 0] < clusters.num_clusters
        cfg = self.config
        assert cfg.key_rank is not None  # QGSConfig resolves None to half the rank
        check_rank("selector 'qgs'", cfg.rank, keys.shape[-1])
        basis, _ = query_geometry(keys, queries, region, cfg.rank - cfg.key_rank, cfg.query_window)
        if cfg.key_rank:
            basis = with_key_spread(basis, keys, region, cfg.key_rank)
        codes, scales = quantize(project(keys, basis))
        return QGSIndex(basis, codes, scales)

    def scoring_bytes(self, head_dim: int) -> float:
        return self.config.rank + 4  # int8 codes and a float32 scale

    def token_codes(self, index: QGSIndex, keys: Tensor) -> dict[str, Tensor]:
        codes, scales = quantize(project(keys, index.basis))
        return {"codes": codes, "scales": scales}

    def score(self, query: Tensor, index: QGSIndex, keys: Tensor, scale: float) -> Tensor:
        B, Hkv, Gs, G, T, D = query.shape
        projected = query.float().reshape(B, Hkv, Gs * G * T, D) @ index.basis  # U_rᵀq, rows (head, query)
        # The fused kernel takes the group maximum before the positive factor s·scale_i (scales are > 0 by
        # construction); a non-positive s goes to the reference, which reduces after scaling.
        if triton_path.unavailable_reason(query.device) is None and scale > 0:
            return group_int8_scores(projected, index.codes, index.scales, scale, T, G)
        scores = (projected @ index.codes.float().transpose(-1, -2)) * (scale * index.scales[:, :, None, :])
        return scores.view(B, Hkv, Gs, G, T, -1).amax(3)


def group_int8_scores(
    projected: Tensor,
    codes: Tensor,
    scales: Tensor,
    scale: float,
    queries: int,
    group: int,
    *,
    block_n: int | None = None,
    num_warps: int = 4,
    out: Tensor | None = None,
) -> Tensor:
    """The selection scores in one pass over the int8 codes: projected queries ``[B, Hkv, g·T, r]`` (rows ordered
    (head in the KV group, query), T = ``queries``), codes ``[B, Hkv, N, r]`` int8, scales ``[B, Hkv, N]`` (> 0),
    ``scale`` s > 0; ``group``: the heads that share one selection (g: ``gqa: shared``, 1: per head) →
    ``[B, Hkv, Gs, T, N]`` float32 (Gs = g/group): s·scale_i·max over the selection head's group of (U_rᵀq)·c_i.
    ``block_n``: tokens per program (default 512, fewer for short rows); ``out``: where to write (contiguous, of the
    output's size), else a new tensor. Launches one kernel and waits for nothing (CUDA-graph capturable)."""
    B, Hkv, Q, r = projected.shape
    N = codes.shape[2]
    T = queries
    Gs = Q // (group * T)
    if Gs * group * T != Q:
        raise ValueError(f"projected queries: {Q} rows is not a multiple of group {group} × queries {T}")
    if out is None:
        out = torch.empty(B, Hkv, Gs, T, N, device=projected.device, dtype=torch.float32)
    elif out.numel() != B * Hkv * Gs * T * N or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(
            f"out: a contiguous float32 tensor of {B * Hkv * Gs * T * N} elements, got {out.dtype} {tuple(out.shape)}"
        )
    if out.numel() == 0:
        return out
    if block_n is None:
        block_n = min(512, max(16, triton.next_power_of_2(N)))
    num_blocks = triton.cdiv(N, block_n)
    _group_int8_scores[(B * Hkv * num_blocks,)](
        projected.contiguous(),
        codes.contiguous(),
        scales.float().contiguous(),
        out,
        N,
        T,
        Gs * T,
        num_blocks,
        scale,
        G=group,
        R=r,
        BLOCK_R=triton.next_power_of_2(r),
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out


if triton is not None:

    @triton.jit
    def _group_int8_scores(
        QP,
        CODES,
        SCALES,
        OUT,
        N,
        T,
        ROWS,
        num_blocks,
        scale,
        G: tl.constexpr,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One program per (batch row, KV head, block of BLOCK_N tokens): the block's codes stay in registers while
        each of the ROWS = Gs·T output rows (row = selection head · T + query) takes the maximum over its G query
        heads of a broadcast multiply-and-sum over r (no padded dot), times s·scale_i. R (the rank) is a constexpr:
        with R = BLOCK_R the r-mask folds away and each thread loads whole 16-byte code rows."""
        pid = tl.program_id(0)
        head = (pid // num_blocks).to(tl.int64)  # (batch row, KV head): B·Hkv·N may pass 2^31
        offs_n = (pid % num_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        in_n = offs_n < N
        codes = tl.load(
            CODES + (head * N + offs_n[:, None]) * R + offs_r[None, :],
            mask=in_n[:, None] & (offs_r[None, :] < R),
            other=0,
        ).to(tl.float32)
        factor = scale * tl.load(SCALES + head * N + offs_n, mask=in_n, other=1.0)
        for row in range(0, ROWS):
            s = (row // T).to(tl.int64)
            t = (row % T).to(tl.int64)
            best = tl.full([BLOCK_N], float("-inf"), tl.float32)
            for j in tl.static_range(G):
                q = tl.load(QP + (head * (ROWS * G) + (s * G + j) * T + t) * R + offs_r, mask=offs_r < R, other=0.0)
                best = tl.maximum(best, tl.sum(codes * q[None, :], axis=1))
            tl.store(OUT + (head * ROWS + row) * N + offs_n, best * factor, mask=in_n)


@hookimpl
def register_selectors(register):
    register(QuerySubspaceSelector)
