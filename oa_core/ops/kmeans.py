"""k-means, shared by the clusterers that use it (QGC in its query-geometry space, key k-means on the raw keys).

- ``lloyd``: seeded k-means++ then Lloyd iterations, batched over (batch row, KV head) problems;
  ``lloyd_iterations``: Lloyd from given centroids; ``nearest``: each point's nearest centroid.
- On CUDA tensors k-means++ (one launch), each Lloyd iteration (one launch) and the nearest centroid are Triton
  kernels; elsewhere torch (``oa_core.ops.geometry.on_gpu`` decides).
"""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core.ops.geometry import on_gpu
from oa_core.ops.scatter import sum_by_slot
from oa_core.ops.triton_path import tl, triton


def lloyd_block(block_r: int) -> int:
    """Points per program of a Lloyd iteration and of ``nearest`` at ``block_r`` dimensions: 128 (of 32 to 512 at 1
    to 8 warps, none was faster on an H200 at 16 dimensions), 16 past 128 dimensions, where a block's tf32x3 dot
    operands outgrow the shared memory (sm_90: 384 KB at 256 dimensions against 227 KB — key k-means on Gemma-3's
    heads; 96 KB with 16 points, and no spills, where 32 points spilled 6 KB a thread in ``_nearest``:
    ``benchmarks/studies/kernel_resources.py``)."""
    return 128 if block_r <= 128 else 16


def plus_plus_block(block_r: int) -> int:
    """Points per block of the k-means++ kernel at ``block_r`` dimensions: 4096 up to 64, then as many values as 4096
    points of 64 (sm_90, 32 warps: 4096 points of 256 dimensions spilled 12 KB a thread, 1024 spill 2.6 KB, as 4096 of
    64 spill 3.1 KB: ``benchmarks/studies/kernel_resources.py``)."""
    return min(4096, 2**18 // block_r)


def lloyd(
    points: Tensor, mask: Tensor, num_clusters: int, iterations: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
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

    centroids = kmeans_plus_plus_triton(flat, weight, draws) if on_gpu(flat) else kmeans_plus_plus(flat, weight, draws)
    assignment, centroids = lloyd_iterations(flat, weight, centroids, iterations)
    return assignment.reshape(*lead, n), centroids.reshape(*lead, num_clusters, r)


def lloyd_iterations(
    points: Tensor, weight: Tensor, centroids: Tensor, iterations: int, check_every: int | None = None
) -> tuple[Tensor, Tensor]:
    """Lloyd from ``centroids`` ``[P, C, r]``: points ``[P, n, r]``, weight ``[P, n]`` (0: not a point) → (each
    point's nearest centroid ``[P, n]``, the centroids it is nearest to ``[P, C, r]``), after ``iterations`` at most
    of: each cluster's mean of its points (an emptied cluster keeps its centre), then each point's nearest mean.

    After a fixed point every iteration gives it again, so whether the last iteration moved a point is asked only
    every ``check_every`` iterations (None: 4 on the GPU, where each question waits for the device; 1 elsewhere).
    On CUDA an iteration is one Triton launch (``_lloyd_step``) over buffers made once, which moves only the sums of
    the points that changed cluster and whose last program computes the next means: at batch 1 an iteration is the
    host's latency of that launch (torch took a dozen)."""
    gpu = on_gpu(points)
    check_every = check_every or (4 if gpu else 1)
    if gpu:
        return _lloyd_triton(points, weight, centroids, iterations, check_every)
    assignment, sums, counts = assign_and_sum(points, weight, centroids)
    for iteration in range(1, iterations + 1):
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centroids)
        updated, sums, counts = assign_and_sum(points, weight, centroids)
        if iteration % check_every == 0 and torch.equal(updated, assignment):
            break
        assignment = updated
    return assignment, centroids


def _lloyd_triton(
    points: Tensor, weight: Tensor, centroids: Tensor, iterations: int, check_every: int
) -> tuple[Tensor, Tensor]:
    """``lloyd_iterations`` on the Triton kernel ``_lloyd_step``, one launch per iteration (launch 0: the first
    assignment). A launch assigns each point, adds the points that changed cluster to their new cluster's sums and
    takes them from their old one's (float64 deltas: few points move after the first iterations, where every point
    added its sums again before), and its last program of each problem turns the sums into the next launch's means.
    The assignment is updated in place; the centroids alternate between two buffers; ``moved[i]`` says whether a
    point changed cluster in launch i."""
    P, n, r = points.shape
    C = centroids.shape[-2]
    if not (n and C):
        return nearest(points, centroids), centroids
    device = points.device
    x = points.float().contiguous()
    w = weight.float().contiguous()
    # [0]: Σx and Σw side by side, [1]: the deltas the launch in flight adds to them.
    sums = torch.zeros(2, P, C, r + 1, dtype=torch.float64, device=device)
    cents = torch.empty(2, P, C, r, dtype=torch.float32, device=device)
    cents[0] = centroids
    assignment = torch.empty(P, n, dtype=torch.long, device=device)
    moved = torch.zeros(iterations + 1, dtype=torch.int32, device=device)
    arrived = torch.zeros(P, dtype=torch.int32, device=device)
    block_r = max(16, triton.next_power_of_2(r))
    block_n = lloyd_block(block_r)
    grid = (triton.cdiv(n, block_n), P)
    for i in range(iterations + 1):
        _lloyd_step[grid](
            x,
            w,
            cents[i % 2],
            cents[(i + 1) % 2],
            assignment,
            sums[0],
            sums[1],
            arrived,
            moved[i:],
            n,
            C,
            R=r,
            BLOCK_R=block_r,
            BLOCK_C=32,
            BLOCK_N=block_n,
            PRECISION="tf32x3",
            FIRST=i == 0,
        )
        if i and i % check_every == 0 and not bool(moved[i]):
            break
    return assignment, cents[i % 2]  # the centroids of the last launch's assignment


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


def kmeans_plus_plus_triton(points: Tensor, weight: Tensor, draws: Tensor, block_n: int | None = None) -> Tensor:
    """``kmeans_plus_plus`` in one Triton launch, a program per row doing all C picks in turn. A pick is one pass over
    the row: the new centre's distances, which leave each block's total in registers; the next pick inverts the CDF
    in the block its draw falls in, found from those totals (float64), without another pass (3.2 against 4.8 ms with
    three passes a pick, at 128 rows of 16K points; 5.9 against 9.5 at 64 of 32K; H200). A pass is a sequence of
    blocks whose latency, not bytes, sets the pace (at batch 1 there are 8 programs): blocks of 4096 points and 32
    warps took 1.8 ms at 8 rows of 32K points and 2.3 ms at 128 of 16K, against 2.8 and 3.2 with 2048 and 8 warps
    (the same picks). The picks equal the torch code's but where a draw falls within rounding of a CDF step (the sums
    run in another order). Past 64 dimensions a block has fewer points, ``plus_plus_block``."""
    P, n, r = points.shape
    C = draws.shape[0]
    centroids = torch.empty(P, C, r, dtype=points.dtype, device=points.device)
    closest = torch.empty(P, n, dtype=torch.float32, device=points.device)
    block_n = min(block_n or plus_plus_block(triton.next_power_of_2(r)), max(16, triton.next_power_of_2(n)))
    blocks = triton.cdiv(n, block_n)
    _kmeans_plus_plus[(P,)](
        points.float().contiguous(),
        weight.float().contiguous(),
        draws.double().contiguous(),
        centroids,
        closest,
        n,
        C,
        P,
        blocks,
        R=r,
        BLOCK_R=triton.next_power_of_2(r),
        BLOCK_N=block_n,
        BLOCKS=triton.next_power_of_2(blocks),
        num_warps=32,
    )
    return centroids


def assign_and_sum(points: Tensor, weight: Tensor, centroids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One Lloyd half-step: points ``[P, n, r]``, weight ``[P, n]`` (0: not a point), centroids ``[P, C, r]`` → (each
    point's nearest centroid ``[P, n]``, its clusters' sums of points ``[P, C, r]`` and of weights ``[P, C]``, over the
    points of nonzero weight), in torch (the GPU's iterations: ``_lloyd_triton``)."""
    C = centroids.shape[-2]
    assignment = nearest(points, centroids)
    slot = assignment.masked_fill(weight == 0, C)  # the unselected points: no cluster
    return assignment, sum_by_slot(slot, points, C), sum_by_slot(slot, weight, C)


NEAREST_CHUNK = 1 << 19  # distances computed at a time on the CPU (2 MiB of float32)


def nearest(points: Tensor, centroids: Tensor) -> Tensor:
    """points ``[..., n, r]``, centroids ``[..., C, r]`` → index of the nearest centroid ``[..., n]`` (the first of
    equals): argmin over b of ‖μ_b‖² − 2·x·μ_b. On CUDA tensors one Triton pass over the points."""
    if points.shape[-2] == 0:  # no points (a decode step that appends none)
        return torch.empty(points.shape[:-1], dtype=torch.long, device=points.device)
    if on_gpu(points):
        return nearest_triton(points, centroids)
    *lead, n, r = points.shape
    flat, means = points.reshape(-1, n, r), centroids.reshape(-1, *centroids.shape[-2:])
    norms, out = (means * means).sum(-1)[:, None, :], points.new_empty(flat.shape[:2], dtype=torch.long)
    step = max(1, NEAREST_CHUNK // max(n * means.shape[1], 1))  # rows whose distances stay in the CPU's cache
    for i in range(0, flat.shape[0], step):
        part = slice(i, i + step)
        out[part] = (norms[part] - 2 * flat[part] @ means[part].transpose(-1, -2)).argmin(-1)
    return out.view(*lead, n)


def nearest_triton(points: Tensor, centroids: Tensor, block_n: int | None = None, precision: str = "tf32x3") -> Tensor:
    """``nearest`` as one Triton kernel: each program takes a block of points against every centroid, a tile of 32
    at a time (the distance matrix never leaves registers), in ``precision`` dots (``tf32x3``: float32's accuracy on
    tensor cores, twice as fast as ``ieee`` on an H200, 0.15 against 0.30 ms at 128 × 16K points and 64 centroids,
    and the same centroids as torch's float32 on those 2M random points)."""
    *lead, n, r = points.shape
    C = centroids.shape[-2]
    flat = points.reshape(-1, n, r).float().contiguous()
    centres = centroids.reshape(-1, C, r).float().contiguous()
    out = torch.empty(flat.shape[:2], dtype=torch.long, device=points.device)
    block_r = max(16, triton.next_power_of_2(r))
    block_n = block_n or lloyd_block(block_r)
    if out.numel():
        _nearest[(triton.cdiv(n, block_n), flat.shape[0])](
            flat, centres, out, n, C, R=r, BLOCK_R=block_r, BLOCK_C=32, BLOCK_N=block_n, PRECISION=precision
        )
    return out.reshape(*lead, n)


if triton is not None:

    @triton.jit
    def _kmeans_plus_plus(
        X,
        W,
        DRAWS,
        CENT,
        CLOSEST,
        n,
        C,
        P,
        nb,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        """Program (row p): its C k-means++ picks. CLOSEST holds weight·(squared distance to the nearest centre); the
        registers hold its ``nb`` block totals (``block_sums``) and the weights' (``weight_sums``), float64."""
        p = tl.program_id(0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        in_r = offs_r < R
        offs_b = tl.arange(0, BLOCKS)
        weight_sums = tl.zeros([BLOCKS], tl.float64)
        total = tl.zeros([], tl.float64)
        for b in range(nb):  # the first pick's weights: the points' own
            offs = b * BLOCK_N + tl.arange(0, BLOCK_N)
            block = tl.sum(tl.load(W + p * n + offs, mask=offs < n, other=0.0).to(tl.float64), axis=0)
            weight_sums = tl.where(offs_b == b, block, weight_sums)
            total += block
        block_sums = weight_sums
        by_weight = total >= 0  # the pick inverts the weights' CDF (the first; or every point a centre already)
        for j in range(0, C):
            # The CDF's inversion: the first point whose running weight reaches draw × total, in the first block
            # whose running total reaches it.
            target = tl.load(DRAWS + j * P + p) * total
            sums = tl.where(by_weight, weight_sums, block_sums)
            ends = tl.cumsum(sums, axis=0)
            first = tl.sum(((offs_b < nb) & (ends < target)).to(tl.int64), axis=0)
            running = tl.sum(tl.where(offs_b < first, sums, 0.0), axis=0)
            at = first * BLOCK_N + tl.arange(0, BLOCK_N)
            inside = at < n
            if by_weight:
                w = tl.load(W + p * n + at, mask=inside, other=0.0).to(tl.float64)
            else:
                w = tl.load(CLOSEST + p * n + at, mask=inside, other=0.0).to(tl.float64)
            cdf = running + tl.cumsum(w, axis=0)
            below = tl.minimum(first * BLOCK_N, n) + tl.sum((inside & (cdf < target)).to(tl.int64), axis=0)
            chosen = tl.minimum(below, n - 1)
            centre = tl.load(X + (p * n + chosen) * R + offs_r, mask=in_r, other=0.0)
            tl.store(CENT + (p * C + j) * R + offs_r, centre, mask=in_r)
            # The new centre's distances, their block totals, and the next pick's total.
            total = tl.zeros([], tl.float64)
            for b in range(nb):
                offs = b * BLOCK_N + tl.arange(0, BLOCK_N)
                in_n = offs < n
                x = tl.load(
                    X + (p * n + offs[:, None]) * R + offs_r[None, :], mask=in_n[:, None] & in_r[None, :], other=0.0
                )
                diff = x - centre[None, :]
                d = tl.sum(diff * diff, axis=1) * tl.load(W + p * n + offs, mask=in_n, other=0.0)
                if j > 0:
                    d = tl.minimum(d, tl.load(CLOSEST + p * n + offs, mask=in_n, other=0.0))
                tl.store(CLOSEST + p * n + offs, d, mask=in_n)
                block = tl.sum(d.to(tl.float64), axis=0)
                block_sums = tl.where(offs_b == b, block, block_sums)
                total += block
            by_weight = total <= 0
            if by_weight:
                total = tl.sum(weight_sums, axis=0)
            tl.debug_barrier()  # the next pick reads CLOSEST in another layout: other threads' stores, visible

    @triton.jit
    def _nearest_centroid(
        x,
        CENT,
        p,
        C,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Points ``x`` ``[BLOCK_N, BLOCK_R]`` → each one's argmin over problem p's centroids CENT ``[C, R]`` of
        ‖μ‖² − 2·x·μ, first of equals, a tile of BLOCK_C centroids at a time (the distances stay in registers)."""
        offs_r = tl.arange(0, BLOCK_R)
        best = tl.full([BLOCK_N], float("inf"), tl.float32)
        best_index = tl.zeros([BLOCK_N], tl.int64)
        for c0 in range(0, C, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            in_c = offs_c < C
            centre = tl.load(
                CENT + (p * C + offs_c[:, None]) * R + offs_r[None, :],
                mask=in_c[:, None] & (offs_r[None, :] < R),
                other=0.0,
            )
            norm = tl.sum(centre * centre, axis=1)
            distance = norm[None, :] - 2 * tl.dot(x, tl.trans(centre), input_precision=PRECISION)
            distance = tl.where(in_c[None, :], distance, float("inf"))
            low = tl.min(distance, axis=1)
            # The first column reaching the tile's minimum (ties: the earlier centroid).
            index = tl.min(tl.where(distance == low[:, None], offs_c[None, :], C), axis=1).to(tl.int64)
            better = low < best
            best = tl.where(better, low, best)
            best_index = tl.where(better, index, best_index)
        return best_index

    @triton.jit
    def _load_points(X, p, n, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        in_n = offs_n < n
        x = tl.load(
            X + (p * n + offs_n[:, None]) * R + offs_r[None, :], mask=in_n[:, None] & (offs_r[None, :] < R), other=0.0
        )
        return x, offs_n, in_n

    @triton.jit
    def _nearest(
        X,
        CENT,
        OUT,
        n,
        C,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Program (block of points, problem): each point's nearest centroid."""
        p = tl.program_id(1).to(tl.int64)
        x, offs_n, in_n = _load_points(X, p, n, R, BLOCK_R, BLOCK_N)
        tl.store(
            OUT + p * n + offs_n, _nearest_centroid(x, CENT, p, C, R, BLOCK_R, BLOCK_C, BLOCK_N, PRECISION), mask=in_n
        )

    @triton.jit
    def _lloyd_step(
        X,
        W,
        CENT,
        CENT_NEXT,
        ASSIGNMENT,
        SUMS,
        DELTAS,
        ARRIVED,
        MOVED,
        n,
        C,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        FIRST: tl.constexpr,
    ):
        """Program (block of points, problem): one Lloyd iteration's assignment and its share of the next means.

        Each point of the block takes its nearest centroid in CENT (ASSIGNMENT, in place); one that changed cluster
        sets MOVED and, if its weight W is nonzero, adds (x, w) to its new cluster's row of DELTAS ``[C, R + 1]`` and
        takes it from its old one's (FIRST: every point of nonzero weight adds, from no cluster). The program that
        arrives last in its problem (ARRIVED counts them) adds DELTAS into SUMS, zeroes DELTAS and ARRIVED, and stores
        the means at CENT_NEXT — IEEE-divided, an emptied cluster keeping its centre — for the next launch."""
        p = tl.program_id(1).to(tl.int64)
        x, offs_n, in_n = _load_points(X, p, n, R, BLOCK_R, BLOCK_N)
        best = _nearest_centroid(x, CENT, p, C, R, BLOCK_R, BLOCK_C, BLOCK_N, PRECISION)
        offs_r = tl.arange(0, BLOCK_R)
        in_r = offs_r < R
        w = tl.load(W + p * n + offs_n, mask=in_n, other=0.0)
        if FIRST:
            changed = in_n
        else:
            before = tl.load(ASSIGNMENT + p * n + offs_n, mask=in_n, other=0)
            changed = in_n & (best != before)
        tl.store(ASSIGNMENT + p * n + offs_n, best, mask=in_n)
        if tl.max(changed.to(tl.int32), axis=0) > 0:
            tl.atomic_max(MOVED, 1, sem="relaxed")
            go = changed & (w != 0)
            xd, wd = x.to(tl.float64), w.to(tl.float64)
            into = (p * C + best) * (R + 1)
            tl.atomic_add(DELTAS + into[:, None] + offs_r[None, :], xd, mask=go[:, None] & in_r[None, :], sem="relaxed")
            tl.atomic_add(DELTAS + into + R, wd, mask=go, sem="relaxed")
            if not FIRST:
                out_of = (p * C + before) * (R + 1)
                tl.atomic_add(
                    DELTAS + out_of[:, None] + offs_r[None, :], -xd, mask=go[:, None] & in_r[None, :], sem="relaxed"
                )
                tl.atomic_add(DELTAS + out_of + R, -wd, mask=go, sem="relaxed")
        # Every thread's adds are done (the barrier) and released (the arrival's release) before the last program's
        # acquire: it reads them past L1 (.cg).
        tl.debug_barrier()
        if tl.atomic_add(ARRIVED + p, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            for c0 in range(0, C, BLOCK_C):
                offs_c = c0 + tl.arange(0, BLOCK_C)
                in_c = offs_c < C
                tile = in_c[:, None] & in_r[None, :]
                row = (p * C + offs_c) * (R + 1)
                sums = tl.load(
                    SUMS + row[:, None] + offs_r[None, :], mask=tile, other=0.0, cache_modifier=".cg"
                ) + tl.load(DELTAS + row[:, None] + offs_r[None, :], mask=tile, other=0.0, cache_modifier=".cg")
                count = tl.load(SUMS + row + R, mask=in_c, other=0.0, cache_modifier=".cg") + tl.load(
                    DELTAS + row + R, mask=in_c, other=0.0, cache_modifier=".cg"
                )
                tl.store(SUMS + row[:, None] + offs_r[None, :], sums, mask=tile)
                tl.store(SUMS + row + R, count, mask=in_c)
                tl.store(DELTAS + row[:, None] + offs_r[None, :], tl.zeros([BLOCK_C, BLOCK_R], tl.float64), mask=tile)
                tl.store(DELTAS + row + R, tl.zeros([BLOCK_C], tl.float64), mask=in_c)
                centre = tl.load(CENT + (p * C + offs_c[:, None]) * R + offs_r[None, :], mask=tile, other=0.0)
                mean = tl.div_rn(sums.to(tl.float32), tl.maximum(count, 1.0).to(tl.float32)[:, None])
                tl.store(
                    CENT_NEXT + (p * C + offs_c[:, None]) * R + offs_r[None, :],
                    tl.where(count[:, None] > 0, mean, centre),
                    mask=tile,
                )
            tl.store(ARRIVED + p, 0)
