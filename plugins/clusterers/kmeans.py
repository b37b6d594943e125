"""Key k-means (the paper's Table 1 ablation; RetroInfer-style): seeded Lloyd k-means on the raw keys, in all D
dimensions, with no query geometry — what QGC improves on."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Clusterer, Clusters
from oa_core.ops.kmeans import lloyd, nearest


class KMeansConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_clusters: int = Field(default=64, ge=1, description="clusters per (batch row, KV head)")
    iterations: int = Field(default=20, ge=0, description="Lloyd iterations at most (stops earlier at a fixed point)")


class KeyKMeans(Clusterer):
    """Key k-means: Lloyd on the raw keys (seeded k-means++ start)."""

    name = "kmeans"
    Config = KMeansConfig
    config: KMeansConfig

    def fit(self, keys: Tensor, queries: Tensor | None, mask: Tensor, generator: torch.Generator) -> Clusters:
        points = keys.float()
        num_clusters = max(1, min(self.config.num_clusters, int(mask.sum(-1).max())))
        mask = mask[:, None, :].expand(points.shape[:3])
        assignment, centroids = lloyd(points, mask, num_clusters, self.config.iterations, generator)
        return Clusters(assignment.masked_fill(~mask, num_clusters), num_clusters, space=centroids)

    def assign(self, clusters: Clusters, keys: Tensor) -> Tensor:
        return nearest(keys.float(), clusters.space)


@hookimpl
def register_clusterers(register):
    register(KeyKMeans)
