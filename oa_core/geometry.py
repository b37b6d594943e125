"""Query geometry and k-means, shared by the clusterers and selectors that use them (QGC, key k-means, QGS).

- ``query_geometry``: the top-r eigenpairs (U_r, Λ_r) of the queries' second moment M per KV head (paper §3.2):
  ``top_eigenpairs``, by LAPACK on the CPU or by subspace iteration on the GPU (``subspace_eigenpairs``).
- ``lloyd``: seeded k-means++ then Lloyd iterations, batched; ``nearest``: each point's nearest centroid. On CUDA
  tensors k-means++ (one launch) and the nearest centroid are Triton kernels; elsewhere torch.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from oa_core.scatter import sum_by_slot
from oa_core.triton_path import tl, triton

QUERY_WINDOW = 256  # the last prefill queries that estimate the query geometry (and that a layer records for it)


def query_geometry(keys: Tensor, queries: Tensor | None, mask: Tensor, rank: int,
                   window: int) -> tuple[Tensor, Tensor]:
    """Top-``rank`` eigenpairs of the query second moment per KV head.

    keys ``[B, Hkv, N, D]``, queries ``[B, Hq, M, D]`` or None (then the second moment of the keys ``mask`` ``[B, N]``
    selects) → (U_r ``[B, Hkv, D, r]``, Λ_r ``[B, Hkv, r]``), float32, from the float64 moment
    (``top_eigenpairs``). A request's queries are decomposed once for all the components that ask (QGC and QGS), at
    the largest rank any of them asked for so far.
    """
    B, Hkv, _, D = keys.shape
    if queries is not None:
        owner, version, decomposed = _DECOMPOSED.get(id(queries), (None, None, None))
        if owner is not None and owner() is queries and version == (queries._version, window, Hkv) \
                and decomposed[0].shape[-1] >= rank:
            return _top(*decomposed, rank)
        samples = queries[:, :, -window:].double().reshape(B, Hkv, -1, D)  # the group's heads share one geometry
        count = samples.shape[2]
    else:
        samples = keys.double() * mask[:, None, :, None]
        count = mask.sum(-1).clamp_min(1).view(B, 1, 1, 1)
    moment = samples.transpose(-1, -2) @ samples / count
    eigenvalues, eigenvectors = top_eigenpairs(moment, rank)
    if queries is not None:
        _remember(queries, (queries._version, window, Hkv), (eigenvalues, eigenvectors))
    return _top(eigenvalues, eigenvectors, rank)


# id(queries) → (a weak reference to them, (their version, window, KV heads), their eigendecomposition): one per
# request, shared by its components; an entry goes with its queries.
_DECOMPOSED: dict[int, tuple] = {}


def _remember(queries: Tensor, version: tuple, decomposed: tuple[Tensor, Tensor]) -> None:
    key = id(queries)
    _DECOMPOSED[key] = (weakref.ref(queries, lambda _: _DECOMPOSED.pop(key, None)), version, decomposed)


def top_eigenpairs(moment: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """The ``rank`` largest eigenpairs of symmetric PSD matrices ``[..., D, D]`` (float64) → (values ``[..., k]``,
    vectors ``[..., D, k]``) in ascending order, k ≥ ``rank`` (all D from LAPACK), on the moment's device.

    On the CPU, and wherever the iteration's block (2·rank columns) would span the whole space, LAPACK's ``eigh`` of
    every matrix. On the GPU, where a batch of 128×128 decompositions takes ~0.2 s whichever library runs it (H200,
    ``benchmarks/results/prepare_h200.json``), ``subspace_eigenpairs``: the same pairs to a residual of 1e-9·λ_1, in
    a few batched products. Eigenvectors are unique up to sign (and, for equal eigenvalues, up to a rotation inside
    their eigenspace), which no component depends on: QGC's distances and QGS's scores are the same either way."""
    if moment.is_cuda and 2 * rank < moment.shape[-1]:
        return subspace_eigenpairs(moment, rank)
    return tuple(t.to(moment.device) for t in torch.linalg.eigh(moment.cpu()))


def subspace_eigenpairs(moment: Tensor, rank: int, tol: float = 1e-9, check_every: int = 8,
                        max_iterations: int = 1000) -> tuple[Tensor, Tensor]:
    """Top-``rank`` eigenpairs of symmetric PSD ``[P, D, D]`` float64 matrices by block subspace iteration on M²
    with Rayleigh–Ritz: a block of 2·rank orthonormal columns (a fixed seeded start: the same on every device) is
    multiplied by M² and re-orthonormalised (``orthonormalize``) until every one of the top ``rank`` Ritz pairs
    (λ, u) has ‖Mu − λu‖ ≤ ``tol``·λ_1 (checked every ``check_every`` products: each check waits for the device).
    The block's extra columns make the r-th pair converge at (λ_{2r+1}/λ_r)² per product rather than
    (λ_{r+1}/λ_r)²; a matrix whose spectrum is flat there stops at ``max_iterations`` with its residual as small as
    the iteration got it (its top-r subspace is then nearly arbitrary anyway). → (values ``[P, rank]`` ascending,
    vectors ``[P, D, rank]``)."""
    *lead, D, _ = moment.shape
    block = min(D, 2 * rank)
    start = torch.randn(D, block, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # Scaled to a unit trace: M² of a large moment stays in range; the eigenvectors are the same. The shift keeps
    # M²Q of full rank (a moment of fewer samples than the block is singular) and moves no eigenvector.
    scale = moment.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)[..., None, None]
    unit = moment / scale
    square = unit @ unit + 1e-12 * torch.eye(D, dtype=moment.dtype, device=moment.device)
    basis = orthonormalize(start.to(moment.device).expand(*lead, D, block).contiguous())
    for iteration in range(1, max_iterations + 1):
        basis = orthonormalize(square @ basis)
        if iteration % check_every and iteration < max_iterations:
            continue
        values, rotation = torch.linalg.eigh(basis.transpose(-1, -2) @ unit @ basis)
        values, vectors = values[..., -rank:], basis @ rotation[..., -rank:]
        residual = (unit @ vectors - vectors * values[..., None, :]).norm(dim=-2)
        if bool((residual <= tol * values[..., -1:].clamp_min(torch.finfo(torch.float64).tiny)).all()):
            break
    return values * scale[..., 0], vectors


def orthonormalize(columns: Tensor) -> Tensor:
    """An orthonormal basis of the span of ``[..., D, b]`` float64 columns of full rank, in order (the j-th basis
    vector spans the first j columns). On CUDA tensors one Triton program per matrix (modified Gram–Schmidt, twice:
    0.11 ms for 128 matrices of 128 × 32 on an H200, where a batched QR takes 7.1 ms); elsewhere QR."""
    if columns.is_cuda and triton is not None:
        *lead, D, b = columns.shape
        flat = columns.reshape(-1, D, b).contiguous()
        out = torch.empty_like(flat)
        _gram_schmidt[(flat.shape[0],)](flat, out, D, b, BLOCK_D=triton.next_power_of_2(D),
                                        BLOCK_B=triton.next_power_of_2(b), num_warps=8)
        return out.reshape(columns.shape)
    return torch.linalg.qr(columns).Q


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
    flat = points.reshape(-1, n, r).contiguous()
    weight = mask.reshape(-1, n).to(flat.dtype).contiguous()
    # The draws come from the (CPU) generator and are moved to the points' device, so a seed gives the same
    # initial centres on every device; they are shared by the first leading dim (the batch), so a row clusters the
    # same alone or in a padded batch. Each pick inverts the CDF of its weights (k-means++: squared distances).
    draws = torch.rand(num_clusters, 1, *lead[1:], generator=generator, dtype=torch.float64)
    draws = draws.expand(num_clusters, *lead).reshape(num_clusters, -1).to(points.device)

    if flat.is_cuda and triton is not None:
        centroids = kmeans_plus_plus_triton(flat, weight, draws)
    else:
        centroids = kmeans_plus_plus(flat, weight, draws)
    assignment, sums, counts = assign_and_sum(flat, weight, centroids)
    for _ in range(iterations):
        # An emptied cluster keeps its old centre.
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centroids)
        updated, sums, counts = assign_and_sum(flat, weight, centroids)
        if torch.equal(updated, assignment):
            break
        assignment = updated
    return assignment.reshape(*lead, n), centroids.reshape(*lead, num_clusters, r)


def kmeans_plus_plus(points: Tensor, weight: Tensor, draws: Tensor) -> Tensor:
    """k-means++ centres: points ``[P, n, r]``, weight ``[P, n]`` (0: not a point), draws ``[C, P]`` float64 in [0, 1)
    → centroids ``[P, C, r]``. Pick j inverts the CDF of the weights (j = 0) or of weight·(squared distance to the
    nearest centre so far) at draws[j] (searchsorted: the first point whose cumulative weight reaches draw × total); a
    row whose points are all centres already falls back to its weights."""
    P, n, _ = points.shape
    rows = torch.arange(P, device=points.device)

    def pick(weights: Tensor, draw: Tensor) -> Tensor:
        cdf = weights.double().cumsum(-1)
        return torch.searchsorted(cdf, (draw[:, None] * cdf[:, -1:]).contiguous()).squeeze(-1).clamp_max(n - 1)

    centroids = [points[rows, pick(weight, draws[0])]]
    closest = ((points - centroids[0][:, None]) ** 2).sum(-1) * weight
    for draw in draws[1:]:
        centroids.append(points[rows, pick(closest + weight * (closest.sum(-1, keepdim=True) <= 0), draw)])
        closest = torch.minimum(closest, ((points - centroids[-1][:, None]) ** 2).sum(-1) * weight)
    return torch.stack(centroids, dim=1)


def kmeans_plus_plus_triton(points: Tensor, weight: Tensor, draws: Tensor, block_n: int = 1024) -> Tensor:
    """``kmeans_plus_plus`` in one Triton launch, a program per row doing all C picks in turn (a pick's two passes
    over the row: the distances to the new centre with the total, then the CDF's scan in float64). The picks equal
    the torch code's but where a draw falls within rounding of a CDF step (the scans sum in another order)."""
    P, n, r = points.shape
    C = draws.shape[0]
    centroids = torch.empty(P, C, r, dtype=points.dtype, device=points.device)
    closest = torch.empty(P, n, dtype=torch.float32, device=points.device)
    _kmeans_plus_plus[(P,)](points.float().contiguous(), weight.float().contiguous(), draws.double().contiguous(),
                            centroids, closest, n, C, P, R=r, BLOCK_R=triton.next_power_of_2(r),
                            BLOCK_N=min(block_n, max(16, triton.next_power_of_2(n))), num_warps=8)
    return centroids


def assign_and_sum(points: Tensor, weight: Tensor, centroids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One Lloyd half-step: points ``[P, n, r]``, weight ``[P, n]`` (0: not a point), centroids ``[P, C, r]`` → (each
    point's nearest centroid ``[P, n]``, its clusters' weighted sums ``[P, C, r]`` and weights ``[P, C]``). (Summing
    inside the nearest-centroid kernel, per block then over blocks, measured slower on an H200 than torch's
    scatter-add after it: 0.58 against 0.34 ms at 128 × 16K points.)"""
    C = centroids.shape[-2]
    assignment = nearest(points, centroids)
    slot = assignment.masked_fill(weight == 0, C)  # the unselected points: no cluster
    return assignment, sum_by_slot(slot, points, C), sum_by_slot(slot, weight, C)


def nearest(points: Tensor, centroids: Tensor) -> Tensor:
    """points ``[..., n, r]``, centroids ``[..., C, r]`` → index of the nearest centroid ``[..., n]`` (the first of
    equals): argmin over b of ‖μ_b‖² − 2·x·μ_b. On CUDA tensors one Triton pass over the points."""
    if points.is_cuda and triton is not None:
        return nearest_triton(points, centroids)
    distance = (centroids * centroids).sum(-1)[..., None, :] - 2 * points @ centroids.transpose(-1, -2)
    return distance.argmin(-1)


def nearest_triton(points: Tensor, centroids: Tensor, block_n: int = 128, precision: str = "tf32x3") -> Tensor:
    """``nearest`` as one Triton kernel: each program takes a block of points against every centroid, a tile of 32
    at a time (the distance matrix never leaves registers), in ``precision`` dots (``tf32x3``: float32's accuracy on
    tensor cores, twice as fast as ``ieee`` on an H200, 0.15 against 0.30 ms at 128 × 16K points and 64 centroids,
    and the same centroids as torch's float32 on those 2M random points)."""
    *lead, n, r = points.shape
    C = centroids.shape[-2]
    flat = points.reshape(-1, n, r).float().contiguous()
    centres = centroids.reshape(-1, C, r).float().contiguous()
    out = torch.empty(flat.shape[:2], dtype=torch.long, device=points.device)
    if out.numel():
        _nearest[(triton.cdiv(n, block_n), flat.shape[0])](flat, centres, out, n, C, R=r,
                                                            BLOCK_R=max(16, triton.next_power_of_2(r)),
                                                            BLOCK_C=32, BLOCK_N=block_n, PRECISION=precision)
    return out.reshape(*lead, n)


if triton is not None:

    @triton.jit
    def _gram_schmidt(Y, OUT, D, B, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr):
        """Program (matrix): modified Gram–Schmidt over its ``B`` columns of ``D`` rows, held in registers, done twice
        (the second pass removes what rounding left of the first's projections)."""
        p = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        offs_b = tl.arange(0, BLOCK_B)
        inside = (offs_d[:, None] < D) & (offs_b[None, :] < B)
        at = (p * D + offs_d[:, None]) * B + offs_b[None, :]
        y = tl.load(Y + at, mask=inside, other=0.0)
        for _ in range(2):
            for j in range(0, B):
                this = offs_b[None, :] == j
                column = tl.sum(tl.where(this, y, 0.0), axis=1)
                column = column / tl.sqrt(tl.sum(column * column, axis=0))
                y = tl.where(this, column[:, None], y)
                later = tl.where(offs_b > j, tl.sum(y * column[:, None], axis=0), 0.0)
                y = y - column[:, None] * later[None, :]
        tl.store(OUT + at, y, mask=inside)

    @triton.jit
    def _kmeans_plus_plus(X, W, DRAWS, CENT, CLOSEST, n, C, P, R: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_N: tl.constexpr):
        """Program (row p): its C k-means++ picks. CLOSEST holds weight·(squared distance to the nearest centre)."""
        p = tl.program_id(0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        in_r = offs_r < R
        total = tl.zeros([], tl.float64)
        for start in range(0, n, BLOCK_N):  # the first pick's weights: the points' own
            offs = start + tl.arange(0, BLOCK_N)
            total += tl.sum(tl.load(W + p * n + offs, mask=offs < n, other=0.0).to(tl.float64), axis=0)
        fallback = total < 0  # False: set after each pick
        for j in range(0, C):
            # The CDF's inversion: the first point whose running weight reaches draw × total.
            target = tl.load(DRAWS + j * P + p) * total
            running = tl.zeros([], tl.float64)
            below = tl.zeros([], tl.int64)
            for start in range(0, n, BLOCK_N):
                offs = start + tl.arange(0, BLOCK_N)
                in_n = offs < n
                if j == 0:
                    w = tl.load(W + p * n + offs, mask=in_n, other=0.0).to(tl.float64)
                else:
                    w = tl.load(CLOSEST + p * n + offs, mask=in_n, other=0.0).to(tl.float64)
                    if fallback:  # every point a centre already: uniform over the points
                        w += tl.load(W + p * n + offs, mask=in_n, other=0.0).to(tl.float64)
                cdf = running + tl.cumsum(w, axis=0)
                below += tl.sum((in_n & (cdf < target)).to(tl.int64), axis=0)
                running += tl.sum(w, axis=0)
            chosen = tl.minimum(below, n - 1)
            centre = tl.load(X + (p * n + chosen) * R + offs_r, mask=in_r, other=0.0)
            tl.store(CENT + (p * C + j) * R + offs_r, centre, mask=in_r)
            # The new centre's distances, and the next pick's total.
            total = tl.zeros([], tl.float64)
            for start in range(0, n, BLOCK_N):
                offs = start + tl.arange(0, BLOCK_N)
                in_n = offs < n
                x = tl.load(X + (p * n + offs[:, None]) * R + offs_r[None, :], mask=in_n[:, None] & in_r[None, :],
                            other=0.0)
                diff = x - centre[None, :]
                d = tl.sum(diff * diff, axis=1) * tl.load(W + p * n + offs, mask=in_n, other=0.0)
                if j > 0:
                    d = tl.minimum(d, tl.load(CLOSEST + p * n + offs, mask=in_n, other=0.0))
                tl.store(CLOSEST + p * n + offs, d, mask=in_n)
                total += tl.sum(d.to(tl.float64), axis=0)
            fallback = total <= 0
            if fallback:
                total = tl.zeros([], tl.float64)
                for start in range(0, n, BLOCK_N):
                    offs = start + tl.arange(0, BLOCK_N)
                    total += tl.sum(tl.load(W + p * n + offs, mask=offs < n, other=0.0).to(tl.float64), axis=0)

    @triton.jit
    def _nearest(X, CENT, OUT, n, C, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """Program (block of points, problem): each point's argmin over centroids of ‖μ‖² − 2·x·μ, first of equals."""
        p = tl.program_id(1).to(tl.int64)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        in_n, in_r = offs_n < n, offs_r < R
        x = tl.load(X + (p * n + offs_n[:, None]) * R + offs_r[None, :], mask=in_n[:, None] & in_r[None, :], other=0.0)
        best = tl.full([BLOCK_N], float("inf"), tl.float32)
        best_index = tl.zeros([BLOCK_N], tl.int64)
        for c0 in range(0, C, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            in_c = offs_c < C
            centre = tl.load(CENT + (p * C + offs_c[:, None]) * R + offs_r[None, :],
                             mask=in_c[:, None] & in_r[None, :], other=0.0)
            norm = tl.sum(centre * centre, axis=1)
            distance = norm[None, :] - 2 * tl.dot(x, tl.trans(centre), input_precision=PRECISION)
            distance = tl.where(in_c[None, :], distance, float("inf"))
            low = tl.min(distance, axis=1)
            # The first column reaching the tile's minimum (ties: the earlier centroid).
            index = tl.min(tl.where(distance == low[:, None], offs_c[None, :], C), axis=1).to(tl.int64)
            better = low < best
            best = tl.where(better, low, best)
            best_index = tl.where(better, index, best_index)
        tl.store(OUT + p * n + offs_n, best_index, mask=in_n)
