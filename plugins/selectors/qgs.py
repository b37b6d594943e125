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
        scores = (q @ index.codes.float().transpose(-1, -2)) * (scale * index.scales[:, :, None, :])
        return scores.view(B, Hq, T, -1)


@hookimpl
def register_selectors(register):
    register(QuerySubspaceSelector)
