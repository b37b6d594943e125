"""PQS's prepare on the GPU: every sub-space's k-means in one launch (``train_triton``), every key's codes in one more
(``encode_triton``), and the nearest-centroid arithmetic they share with the fused step's prologue, which codes the
new row each decode step (``oa_plugins.kernels.flash_step_programs``).

The k-means is the torch code's (``oa_core.ops.kmeans.lloyd_iterations`` from ``pq.initial_centroids``): the
chosen training keys at evenly spaced ranks as the starting centroids, then ``iterations`` rounds of each point's
nearest centroid (argmin of ‖μ‖² − 2·x·μ, the first of equals) and each cluster's mean of its chosen points (an
emptied cluster keeps its centre). It runs every round: once no point moves, a round gives the same centroids again,
where the torch loop stops. A program is one (batch row, KV head, sub-space) problem with its centroids in
registers, reading its training keys' few coordinates from the cache itself — no copy of the points, no atomics, no
host round trip between rounds (the shared Lloyd kernels, made for QGC's 64 clusters of 16 dimensions, padded each
2-dimensional point to 16 and launched once a round).
"""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core.ops.triton_path import tl, triton

# A training program's block of centroids × their block of dimensions at most (16 × 2 for the default, 256 × 2 for
# 8-bit codes of pairs): past it, ``fits`` says no and the shared Lloyd kernels run. At 4 warps and sm_90, 256 × 2
# took 216 registers a thread and 256 × 4 spilled 56 bytes (``benchmarks/studies/kernel_resources.py``' compiler).
MAX_TILE = 512
# Elements of a training program's block (points × centroids × dimensions), which sets its points per block: each
# lane keeps its share of the sums over the blocks, added up once a round. The default's 64 points a block took 123
# registers a thread, 128 points 182.
TRAIN_ELEMENTS = 2048
# Rows (key, sub-space) an encoding program codes at a time: keys per block × sub-spaces, at least one key.
ENCODE_ROWS = 256


def blocks(sub_spaces: int, centroids: int, dims: int) -> tuple[int, int, int]:
    """The programs' blocks of sub-spaces, centroids and a sub-space's dimensions: powers of two (at least 2 sub-spaces:
    codes are packed in pairs)."""
    return max(2, triton.next_power_of_2(sub_spaces)), triton.next_power_of_2(centroids), triton.next_power_of_2(dims)


def train_points(centroids: int, dims: int) -> int:
    """Training points a k-means program takes a block at a time (``TRAIN_ELEMENTS``), at least 16."""
    _, block_c, block_dims = blocks(1, centroids, dims)
    return max(16, TRAIN_ELEMENTS // (block_c * block_dims))


def encode_keys(sub_spaces: int) -> int:
    """Keys an encoding program codes at a time, each with every sub-space (``ENCODE_ROWS``), at least one."""
    return max(1, ENCODE_ROWS // blocks(sub_spaces, 1, 1)[0])


def fits(centroids: int, dims: int) -> bool:
    """Whether ``train_triton`` holds a problem's centroids in registers (``MAX_TILE``)."""
    return triton is not None and triton.next_power_of_2(centroids) * triton.next_power_of_2(dims) <= MAX_TILE


def train_triton(keys: Tensor, positions: Tensor, chosen: Tensor, dims: int, count: int, iterations: int) -> Tensor:
    """keys ``[B, Hkv, N, D]`` (any float dtype, unit stride in D), the training keys' positions ``[B, n]`` with the
    chosen ones first and which are chosen ``[B, n]`` bool (``pq.training_positions``) → each sub-space's ``count``
    centroids ``[B, Hkv, D / dims, count, dims]`` float32, after ``iterations`` Lloyd rounds."""
    B, Hkv, N, D = keys.shape
    M, n = D // dims, positions.shape[-1]
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    _, block_c, block_dims = blocks(M, count, dims)
    centroids = torch.empty(B, Hkv, M, count, dims, dtype=torch.float32, device=keys.device)
    if centroids.numel() and n:
        _pq_train[(B * Hkv * M,)](
            keys,
            *keys.stride()[:3],
            positions.to(torch.int64).contiguous(),
            chosen.to(torch.int8).contiguous(),
            centroids,
            Hkv,
            M,
            n,
            count,
            iterations,
            DIMS=dims,
            BLOCK_C=block_c,
            BLOCK_DIMS=block_dims,
            BLOCK_N=train_points(count, dims),
        )
    return centroids


def encode_triton(keys: Tensor, centroids: Tensor, packed: bool) -> Tensor:
    """keys ``[B, Hkv, N, D]``, centroids ``[B, Hkv, M, C, dims]`` → codes ``[B, Hkv, N, W]`` uint8 as ``pq.encode``
    makes them (two a byte where ``packed``): each sub-space's nearest centroid, in one launch."""
    B, Hkv, N, D = keys.shape
    M, C, dims = centroids.shape[2:]
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    block_m, block_c, block_dims = blocks(M, C, dims)
    W = (M + 1) // 2 if packed else M
    codes = torch.empty(B, Hkv, N, W, dtype=torch.uint8, device=keys.device)
    block_k = encode_keys(M)
    if codes.numel():
        _pq_encode[(B * Hkv, triton.cdiv(N, block_k))](
            keys,
            *keys.stride()[:3],
            centroids.float().contiguous(),
            codes,
            Hkv,
            N,
            M=M,
            C=C,
            DIMS=dims,
            W=W,
            PACKED=packed,
            BLOCK_K=block_k,
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            BLOCK_DIMS=block_dims,
        )
    return codes


if triton is not None:

    @triton.jit
    def tile_nearest(k, centre, offs_c, c_ok, C):
        """Rows of points ``k`` ``[R, BLOCK_DIMS]`` against a tile of centroids ``centre`` ``[R or 1, BLOCK_C,
        BLOCK_DIMS]`` (``offs_c`` their numbers, ``c_ok`` those that exist) → (each row's lowest ‖μ‖² − 2·k·μ
        ``[R]``, the first centroid reaching it ``[R]``; C where none exists)."""
        distance = tl.sum(centre * centre, axis=2) - 2.0 * tl.sum(k[:, None, :] * centre, axis=2)
        distance = tl.where(c_ok[None, :], distance, float("inf"))
        low = tl.min(distance, axis=1)
        return low, tl.min(tl.where(distance == low[:, None], offs_c[None, :], C), axis=1)

    @triton.jit
    def nearest_code(
        k,
        CENT,
        sub,
        row_ok,
        C,
        DIMS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_DIMS: tl.constexpr,
    ):
        """Rows of points ``k`` ``[BLOCK_R, BLOCK_DIMS]`` float32, row r in sub-space ``sub[r]`` whose C centroids
        are at CENT + sub·C·DIMS (``row_ok``: the rows that exist) → each row's nearest centroid ``[BLOCK_R]`` int32,
        the first of equals, a tile of BLOCK_C centroids at a time (a later tile's equal does not displace it)."""
        offs_e = tl.arange(0, BLOCK_DIMS)
        best = tl.full([BLOCK_R], float("inf"), tl.float32)
        code = tl.zeros([BLOCK_R], tl.int32)
        for c0 in range(0, C, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            c_ok = offs_c < C
            centre = tl.load(
                CENT + ((sub[:, None, None] * C + offs_c[None, :, None]) * DIMS + offs_e[None, None, :]),
                mask=row_ok[:, None, None] & c_ok[None, :, None] & (offs_e < DIMS)[None, None, :],
                other=0.0,
            )
            low, first = tile_nearest(k, centre, offs_c, c_ok, C)
            better = low < best
            code = tl.where(better, first, code)
            best = tl.where(better, low, best)
        return code

    @triton.jit
    def store_codes(
        CODES, code, rows, rows_ok, W, M, PACKED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr
    ):
        """Codes ``[BLOCK_K · BLOCK_M]`` (key-major) into the rows ``rows`` ``[BLOCK_K]`` of CODES, W bytes each, as
        the index keeps them: two a byte where PACKED, sub-space 2j in byte j's low nibble (``pq.pack_codes``; a
        sub-space past M codes 0)."""
        code = tl.where((tl.arange(0, BLOCK_K * BLOCK_M) % BLOCK_M) < M, code, 0)
        if PACKED:
            low, high = tl.split(tl.reshape(code, [BLOCK_K, BLOCK_M // 2, 2]))
            offs_w = tl.arange(0, BLOCK_M // 2)
            byte = low | (high << 4)
        else:
            offs_w = tl.arange(0, BLOCK_M)
            byte = tl.reshape(code, [BLOCK_K, BLOCK_M])
        tl.store(
            CODES + rows[:, None] * W + offs_w[None, :],
            byte.to(tl.uint8),
            mask=rows_ok[:, None] & (offs_w < W)[None, :],
        )

    @triton.jit
    def _pq_encode(
        KEYS,
        sk_b,
        sk_h,
        sk_n,
        CENT,
        CODES,
        Hkv,
        N,
        M: tl.constexpr,
        C: tl.constexpr,
        DIMS: tl.constexpr,
        W: tl.constexpr,
        PACKED: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_DIMS: tl.constexpr,
    ):
        """Program (batch row · KV head, block of BLOCK_K keys): the block's codes, a row per (key, sub-space)."""
        head = tl.program_id(0).to(tl.int64)
        b = head // Hkv
        h = head % Hkv
        offs = tl.arange(0, BLOCK_K * BLOCK_M)
        sub = offs % BLOCK_M
        key = tl.program_id(1).to(tl.int64) * BLOCK_K + offs // BLOCK_M
        row_ok = (sub < M) & (key < N)
        offs_e = tl.arange(0, BLOCK_DIMS)
        k = tl.load(
            KEYS + b * sk_b + h * sk_h + key[:, None] * sk_n + sub[:, None] * DIMS + offs_e[None, :],
            mask=row_ok[:, None] & (offs_e < DIMS)[None, :],
            other=0.0,
        ).to(tl.float32)
        code = nearest_code(k, CENT + head * M * C * DIMS, sub, row_ok, C, DIMS, BLOCK_K * BLOCK_M, BLOCK_C, BLOCK_DIMS)
        rows = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        store_codes(CODES + head * N * W, code, rows, rows < N, W, M, PACKED, BLOCK_K, BLOCK_M)

    @triton.jit
    def _pq_train(
        KEYS,
        sk_b,
        sk_h,
        sk_n,
        POS,
        CHOSEN,
        CENT,
        Hkv,
        M,
        n,
        C,
        iterations,
        DIMS: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_DIMS: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Program (batch row, KV head, sub-space): its centroids' k-means over the row's n training positions POS
        (CHOSEN first: the points; the rest fill the row), the centroids in registers throughout."""
        pid = tl.program_id(0).to(tl.int64)
        bh = pid // M
        b = bh // Hkv
        base = KEYS + b * sk_b + (bh % Hkv) * sk_h + (pid % M) * DIMS
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        offs_e = tl.arange(0, BLOCK_DIMS)
        e_ok = offs_e < DIMS
        available = tl.zeros([], tl.int64)
        for n0 in range(0, n, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            available += tl.sum(tl.load(CHOSEN + b * n + offs, mask=offs < n, other=0).to(tl.int64), axis=0)
        # The start: the chosen points at evenly spaced ranks, repeated where there are fewer than C.
        rank = tl.minimum((offs_c * available) // C, tl.maximum(available - 1, 0))
        start = tl.load(POS + b * n + rank, mask=c_ok, other=0)
        cent = tl.load(base + start[:, None] * sk_n + offs_e[None, :], mask=c_ok[:, None] & e_ok[None, :], other=0.0)
        cent = cent.to(tl.float32)
        for _round in range(iterations):
            # Each lane's share of the sums, added up once a round (not once a block of points).
            sums = tl.zeros([BLOCK_N, BLOCK_C, BLOCK_DIMS], tl.float32)
            counts = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
            for n0 in range(0, n, BLOCK_N):
                offs = n0 + tl.arange(0, BLOCK_N)
                in_n = offs < n
                pos = tl.load(POS + b * n + offs, mask=in_n, other=0)
                weight = tl.load(CHOSEN + b * n + offs, mask=in_n, other=0).to(tl.float32)
                x = tl.load(base + pos[:, None] * sk_n + offs_e[None, :], mask=in_n[:, None] & e_ok[None, :], other=0.0)
                x = x.to(tl.float32)
                _, first = tile_nearest(x, cent[None, :, :], offs_c, c_ok, C)
                member = (first[:, None] == offs_c[None, :]) & (weight > 0)[:, None]  # [BLOCK_N, BLOCK_C]
                counts += tl.where(member, weight[:, None], 0.0)
                sums += tl.where(member[:, :, None], x[:, None, :], 0.0)
            count = tl.sum(counts, axis=0)
            cent = tl.where(count[:, None] > 0, tl.sum(sums, axis=0) / tl.maximum(count, 1.0)[:, None], cent)
        tl.store(CENT + (pid * C + offs_c[:, None]) * DIMS + offs_e[None, :], cent, mask=c_ok[:, None] & e_ok[None, :])
