"""QGC — Query-Geometry Clustering (OpenAttention paper, §3.2, Eq. 4).

Keys whose logits move together under the queries belong together: since E_q(z_i − z_j)² = s²(k_i − k_j)ᵀM(k_i − k_j)
with M the queries' second moment, k-means on Φ = K U_r Λ_r^{1/2} (top-r eigenpairs of M) minimises the
within-cluster logit variance, in r ≪ D dimensions.

M here is M̄_q, the second moment of this request's last ``query_window`` prefill queries of the KV group. The
design's static half M̄_st (a running mean over earlier requests) needs requests, which the transformers integration
has; without it the paper's M = ½M̄_st + ½M̄_q reduces to M̄_q. Without any queries, M falls back to the keys' own
second moment (key-PCA k-means).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Clusterer, Clusters
from oa_core.ops.geometry import QUERY_WINDOW, check_rank, project, query_geometry
from oa_core.ops.kmeans import lloyd, nearest


class QGCConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_clusters: int = Field(default=64, ge=1, description="clusters per (batch row, KV head)")
    rank: int = Field(default=16, ge=1, description="r: dimensions of the query-geometry projection")
    query_window: int = Field(default=QUERY_WINDOW, ge=1, description="last prefill queries that estimate M̄_q")
    iterations: int = Field(default=20, ge=0, description="Lloyd iterations at most (stops earlier at a fixed point)")


class QueryGeometryClusterer(Clusterer):
    """QGC: k-means in the top-r query-geometry subspace (paper Eq. 4)."""

    name = "qgc"
    Config = QGCConfig
    config: QGCConfig

    def fit(self, keys: Tensor, queries: Tensor | None, mask: Tensor, generator: torch.Generator) -> Clusters:
        cfg = self.config
        check_rank("clusterer 'qgc'", cfg.rank, keys.shape[-1])
        basis, eigenvalues = query_geometry(keys, queries, mask, cfg.rank, cfg.query_window)
        projection = basis * eigenvalues.sqrt()[..., None, :]  # U_r Λ_r^{1/2}, [B, Hkv, D, r]
        points = project(keys, projection)
        num_clusters = max(1, min(cfg.num_clusters, int(mask.sum(-1).max())))
        mask = mask[:, None, :].expand(points.shape[:3])
        assignment, centroids = lloyd(points, mask, num_clusters, cfg.iterations, generator)
        return Clusters(assignment.masked_fill(~mask, num_clusters), num_clusters, space=(projection, centroids))

    def assign(self, clusters: Clusters, keys: Tensor) -> Tensor:
        projection, centroids = clusters.space
        return nearest(project(keys, projection), centroids)


@hookimpl
def register_clusterers(register):
    register(QueryGeometryClusterer)
