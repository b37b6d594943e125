"""Query geometry and k-means, shared by the clusterers and selectors that use them (QGC, key k-means, QGS).

- ``query_geometry``: the top-r eigenpairs (U_r, Λ_r) of the queries' second moment M per KV head (paper §3.2).
- ``lloyd``: seeded k-means++ then Lloyd iterations, batched; ``nearest``: each point's nearest centroid.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from oa_core.scatter import sum_by_slot

QUERY_WINDOW = 256  # the last prefill queries that estimate the query geometry (and that a layer records for it)


def query_geometry(keys: Tensor, queries: Tensor | None, mask: Tensor, rank: int,
                   window: int) -> tuple[Tensor, Tensor]:
    """Top-``rank`` eigenpairs of the query second moment per KV head.

    keys ``[B, Hkv, N, D]``, queries ``[B, Hq, M, D]`` or None (then the second moment of the keys ``mask`` ``[B, N]``
    selects) → (U_r ``[B, Hkv, D, r]``, Λ_r ``[B, Hkv, r]``), float32. The eigendecomposition runs in float64 on the
    CPU (LAPACK), where a batch of small matrices is much faster than on a GPU and a seed means the same basis on
    every device; a request's queries are decomposed once for all the components that ask (QGC and QGS).
    """
    B, Hkv, _, D = keys.shape
    if queries is not None:
        owner, version, decomposed = _DECOMPOSED.get(id(queries), (None, None, None))
        if owner is not None and owner() is queries and version == (queries._version, window, Hkv):
            return _top(*decomposed, rank)
        samples = queries[:, :, -window:].double().reshape(B, Hkv, -1, D)  # the group's heads share one geometry
        count = samples.shape[2]
    else:
        samples = keys.double() * mask[:, None, :, None]
        count = mask.sum(-1).clamp_min(1).view(B, 1, 1, 1)
    moment = samples.transpose(-1, -2) @ samples / count
    eigenvalues, eigenvectors = (t.to(keys.device) for t in torch.linalg.eigh(moment.cpu()))  # ascending
    if queries is not None:
        _remember(queries, (queries._version, window, Hkv), (eigenvalues, eigenvectors))
    return _top(eigenvalues, eigenvectors, rank)


# id(queries) → (a weak reference to them, (their version, window, KV heads), their eigendecomposition): one per
# request, shared by its components; an entry goes with its queries.
_DECOMPOSED: dict[int, tuple] = {}


def _remember(queries: Tensor, version: tuple, decomposed: tuple[Tensor, Tensor]) -> None:
    key = id(queries)
    _DECOMPOSED[key] = (weakref.ref(queries, lambda _: _DECOMPOSED.pop(key, None)), version, decomposed)


def _top(eigenvalues: Tensor, eigenvectors: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    r = min(rank, eigenvectors.shape[-1])
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
    closest = ((flat - centroids[0][:, None]) ** 2).sum(-1) * weight  # squared distance to the nearest centre
    for draw in draws[1:]:
        # A row whose points are all centres already falls back to uniform over its points.
        centroids.append(flat[rows, pick(closest + weight * (closest.sum(-1, keepdim=True) <= 0), draw)])
        closest = torch.minimum(closest, ((flat - centroids[-1][:, None]) ** 2).sum(-1) * weight)
    centroids = torch.stack(centroids, dim=1)

    assignment = nearest(flat, centroids)
    for _ in range(iterations):
        slot = assignment.masked_fill(weight == 0, num_clusters)  # the unselected points: no cluster
        sums, counts = sum_by_slot(slot, flat, num_clusters), sum_by_slot(slot, weight, num_clusters)
        # An emptied cluster keeps its old centre.
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centroids)
        updated = nearest(flat, centroids)
        if torch.equal(updated, assignment):
            break
        assignment = updated
    return assignment.reshape(*lead, n), centroids.reshape(*lead, num_clusters, r)


def nearest(points: Tensor, centroids: Tensor) -> Tensor:
    """points ``[..., n, r]``, centroids ``[..., C, r]`` → index of the nearest centroid ``[..., n]``."""
    distance = (centroids * centroids).sum(-1)[..., None, :] - 2 * points @ centroids.transpose(-1, -2)
    return distance.argmin(-1)
