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


class QGCConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_clusters: int = Field(default=64, ge=1, description="clusters per (batch row, KV head)")
    rank: int = Field(default=16, ge=1, description="r: dimensions of the query-geometry projection")
    query_window: int = Field(default=256, ge=1, description="last prefill queries that estimate M̄_q")
    iterations: int = Field(default=20, ge=0, description="Lloyd iterations at most (stops earlier at a fixed point)")


def query_geometry(keys: Tensor, queries: Tensor | None, mask: Tensor, rank: int,
                   window: int) -> tuple[Tensor, Tensor]:
    """Top-``rank`` eigenpairs of the query second moment per KV head.

    keys ``[B, Hkv, N, D]``, queries ``[B, Hq, M, D]`` or None (then the second moment of the keys ``mask`` ``[B, N]``
    selects) → (U_r ``[B, Hkv, D, r]``, Λ_r ``[B, Hkv, r]``), float32.
    """
    B, Hkv, _, D = keys.shape
    if queries is None:
        samples = keys.double() * mask[:, None, :, None]
        count = mask.sum(-1).clamp_min(1).view(B, 1, 1, 1)
    else:
        samples = queries[:, :, -window:].double().reshape(B, Hkv, -1, D)  # the group's heads share one geometry
        count = samples.shape[2]
    moment = samples.transpose(-1, -2) @ samples / count
    eigenvalues, eigenvectors = torch.linalg.eigh(moment)  # ascending
    r = min(rank, D)
    top = eigenvectors[..., -r:].flip(-1)
    return top.float(), eigenvalues[..., -r:].flip(-1).clamp_min(0).float()


def lloyd(points: Tensor, mask: Tensor, num_clusters: int, iterations: int,
          generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Seeded k-means++ initialisation, then Lloyd iterations, batched over leading dims, on the points ``mask``
    selects.

    points ``[..., n, r]``, mask ``[..., n]`` → (assignment ``[..., n]``, where ``mask`` is False too; centroids
    ``[..., C, r]``). A row with fewer points than C leaves some clusters empty.
    """
    *lead, n, r = points.shape
    flat = points.reshape(-1, n, r)
    weight = mask.reshape(-1, n).to(flat.dtype)
    rows = torch.arange(flat.shape[0], device=points.device)
    # The draws come from the (CPU) generator and are moved to the points' device, so a seed gives the same
    # initial centres on every device; they are shared by the first leading dim (the batch), so a row clusters the
    # same alone or in a padded batch. Each pick inverts the CDF of its weights (k-means++: squared distances).
    draws = torch.rand(num_clusters, 1, *lead[1:], generator=generator, dtype=torch.float64)
    draws = draws.expand(num_clusters, *lead).reshape(num_clusters, -1, 1).to(points.device)

    def pick(weights: Tensor, draw: Tensor) -> Tensor:
        cdf = weights.double().cumsum(-1)
        return torch.searchsorted(cdf, draw * cdf[:, -1:]).squeeze(-1).clamp_max(n - 1)

    centroids = [flat[rows, pick(weight, draws[0])]]
    nearest = ((flat - centroids[0][:, None]) ** 2).sum(-1) * weight
    for draw in draws[1:]:
        # A row whose points are all centres already falls back to uniform over its points.
        centroids.append(flat[rows, pick(nearest + weight * (nearest.sum(-1, keepdim=True) <= 0), draw)])
        nearest = torch.minimum(nearest, ((flat - centroids[-1][:, None]) ** 2).sum(-1) * weight)
    centroids = torch.stack(centroids, dim=1)

    assignment = _nearest(flat, centroids)
    for _ in range(iterations):
        slot = assignment.masked_fill(weight == 0, num_clusters)  # slot C collects the unselected points
        sums = flat.new_zeros(flat.shape[0], num_clusters + 1, r).scatter_add_(1, slot[..., None].expand_as(flat), flat)
        counts = weight.new_zeros(flat.shape[0], num_clusters + 1).scatter_add_(1, slot, weight)
        sums, counts = sums[:, :num_clusters], counts[:, :num_clusters]
        # An emptied cluster keeps its old centre.
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centroids)
        updated = _nearest(flat, centroids)
        if torch.equal(updated, assignment):
            break
        assignment = updated
    return assignment.reshape(*lead, n), centroids.reshape(*lead, num_clusters, r)


def _nearest(points: Tensor, centroids: Tensor) -> Tensor:
    """points ``[..., n, r]``, centroids ``[..., C, r]`` → index of the nearest centroid ``[..., n]``."""
    distance = (centroids * centroids).sum(-1)[..., None, :] - 2 * points @ centroids.transpose(-1, -2)
    return distance.argmin(-1)


class QueryGeometryClusterer(Clusterer):
    """QGC: k-means in the top-r query-geometry subspace (paper Eq. 4)."""

    name = "qgc"
    Config = QGCConfig

    def fit(self, keys: Tensor, queries: Tensor | None, mask: Tensor, generator: torch.Generator) -> Clusters:
        cfg = self.config
        basis, eigenvalues = query_geometry(keys, queries, mask, cfg.rank, cfg.query_window)
        projection = basis * eigenvalues.sqrt()[..., None, :]  # U_r Λ_r^{1/2}, [B, Hkv, D, r]
        points = keys.float() @ projection
        num_clusters = max(1, min(cfg.num_clusters, int(mask.sum(-1).max())))
        mask = mask[:, None, :].expand(points.shape[:3])
        assignment, centroids = lloyd(points, mask, num_clusters, cfg.iterations, generator)
        return Clusters(assignment.masked_fill(~mask, num_clusters), num_clusters, basis=basis,
                        space=(projection, centroids))

    def assign(self, clusters: Clusters, keys: Tensor) -> Tensor:
        projection, centroids = clusters.space
        return _nearest(keys.float() @ projection, centroids)


@hookimpl
def register_clusterers(register):
    register(QueryGeometryClusterer)
