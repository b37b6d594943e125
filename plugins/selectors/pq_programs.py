"""PQS's prepare on the GPU: every sub-space's k-means in one launch (``train_triton``), every key's codes in one more
(``encode_triton``), and the nearest-centroid arithmetic they share with the fused step's prologue, which codes the
new row each decode step (``oa_plugins.kernels.flash_step_programs``).

The k-means is the torch code's (``oa_core.ops.kmeans.lloyd_iterations`` from ``pq.initial_centroids``): the
chosen training keys at evenly spaced ranks as the starting centroids, then ``iterations`` rounds of each point's
nearest centroid (argmin of ‖μ‖² − 2·x·μ, the first of equals) and each cluster's mean of its chosen points (an
emptied cluster keeps its centre). It runs every round: once no point moves, a round gives the same centroids again,
where the torch loop stops. A program is one (batch row, KV head, sub-space) problem: it reads its training keys' few
coordinates from the cache once and keeps them in registers for every round; its centroids go through a few hundred
bytes of its own in the output between rounds — no copy of the points, no atomics, no host round trip (the shared
Lloyd kernels, made for QGC's 64 clusters of 16 dimensions, padded each 2-dimensional point to 16 and launched once
a round). Every nearest centroid is one loop over the centroids, each compared with a block of points at once (no
reduction across the threads); the coding takes a block of keys × every sub-space a program, so that a centroid is
read once for the block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core.ops.triton_path import tl, triton

# Training points a program holds in registers, × their block of dimensions, at most (the default: 4096 keys × 2):
# past it, ``fits`` says no and the shared Lloyd kernels run.
MAX_POINTS = 8192
TRAIN_WARPS = 8
# (Key, sub-space) pairs an encoding program codes at a time: 16 keys of 64 sub-spaces (Llama's head dim 128) took
# 80 registers a thread on sm_90, 32 keys 168.
ENCODE_PAIRS = 1024


def blocks(sub_spaces: int, dims: int) -> tuple[int, int]:
    """The programs' blocks of sub-spaces and of a sub-space's dimensions: powers of two (at least 2 sub-spaces:
    codes are packed in pairs)."""
    return max(2, triton.next_power_of_2(sub_spaces)), triton.next_power_of_2(dims)


def encode_keys(sub_spaces: int) -> int:
    """Keys an encoding program codes at a time, each with every sub-space (``ENCODE_PAIRS``)."""
    return max(1, ENCODE_PAIRS // blocks(sub_spaces, 1)[0])


def fits(points: int, dims: int) -> bool:
    """Whether ``train_triton`` holds a problem's ``points`` training points in registers (``MAX_POINTS``)."""
    return triton is not None and triton.next_power_of_2(points) * triton.next_power_of_2(dims) <= MAX_POINTS


def train_triton(keys: Tensor, positions: Tensor, chosen: Tensor, dims: int, count: int, iterations: int) -> Tensor:
    """keys ``[B, Hkv, N, D]`` (any float dtype, unit stride in D), the training keys' positions ``[B, n]`` with the
    chosen ones first and which are chosen ``[B, n]`` bool (``pq.training_positions``) → each sub-space's ``count``
    centroids ``[B, Hkv, D / dims, count, dims]`` float32, after ``iterations`` Lloyd rounds."""
    B, Hkv, N, D = keys.shape
    M, n = D // dims, positions.shape[-1]
    if not fits(n, dims):
        raise ValueError(f"train_triton: {n} training points of {dims} dimensions past MAX_POINTS ({MAX_POINTS})")
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    _, block_dims = blocks(M, dims)
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
            BLOCK_DIMS=block_dims,
            BLOCK_N=triton.next_power_of_2(n),
            num_warps=TRAIN_WARPS,
        )
    return centroids


def encode_triton(keys: Tensor, centroids: Tensor, packed: bool) -> Tensor:
    """keys ``[B, Hkv, N, D]``, centroids ``[B, Hkv, M, C, dims]`` → codes ``[B, Hkv, N, W]`` uint8 as ``pq.encode``
    makes them (two a byte where ``packed``): each sub-space's nearest centroid, in one launch."""
    B, Hkv, N, D = keys.shape
    M, C, dims = centroids.shape[2:]
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    block_m, block_dims = blocks(M, dims)
    block_k = encode_keys(M)
    W = (M + 1) // 2 if packed else M
    codes = torch.empty(B, Hkv, N, W, dtype=torch.uint8, device=keys.device)
    if codes.numel():
        _pq_encode[(B * Hkv, triton.cdiv(N, block_k))](
            keys,
            *keys.stride()[:3],
            centroids.float().contiguous(),
            codes,
            Hkv,
            N,
            C,
            M=M,
            DIMS=dims,
            W=W,
            PACKED=packed,
            BLOCK_K=block_k,
            BLOCK_M=block_m,
            BLOCK_DIMS=block_dims,
        )
    return codes


if triton is not None:

    @triton.jit
    def nearest_code(x, CENT, offs_m, m_ok, C, DIMS: tl.constexpr, BLOCK_DIMS: tl.constexpr):
        """Points ``x`` ``[K, BLOCK_M, BLOCK_DIMS]`` float32, column m in sub-space ``offs_m[m]`` whose C centroids
        are at CENT + offs_m·C·DIMS (``m_ok``: the sub-spaces that exist) → each point's nearest centroid ``[K,
        BLOCK_M]`` int32: argmin of ‖μ‖² − 2·x·μ, the first of equals, one centroid at a time for every point."""
        offs_e = tl.arange(0, BLOCK_DIMS)
        mask = m_ok[:, None] & (offs_e < DIMS)[None, :]
        best = tl.full([x.shape[0], x.shape[1]], float("inf"), tl.float32)
        code = tl.zeros([x.shape[0], x.shape[1]], tl.int32)
        for j in range(0, C):
            centre = tl.load(CENT + (offs_m[:, None] * C + j) * DIMS + offs_e[None, :], mask=mask, other=0.0)
            distance = tl.sum(centre * centre, axis=1)[None, :] - 2.0 * tl.sum(x * centre[None, :, :], axis=2)
            better = distance < best  # a later equal does not displace an earlier centroid
            code = tl.where(better, j, code)
            best = tl.where(better, distance, best)
        return code

    @triton.jit
    def store_codes(
        CODES, code, rows, rows_ok, W, M, PACKED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr
    ):
        """Codes ``[BLOCK_K, BLOCK_M]`` into the rows ``rows`` ``[BLOCK_K]`` of CODES, W bytes each, as the index keeps
        them: two a byte where PACKED, sub-space 2j in byte j's low nibble (``pq.pack_codes``; a sub-space past M
        codes 0)."""
        code = tl.where((tl.arange(0, BLOCK_M) < M)[None, :], code, 0)
        if PACKED:
            low, high = tl.split(tl.reshape(code, [BLOCK_K, BLOCK_M // 2, 2]))
            offs_w = tl.arange(0, BLOCK_M // 2)
            byte = low | (high << 4)
        else:
            offs_w = tl.arange(0, BLOCK_M)
            byte = code
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
        C,
        M: tl.constexpr,
        DIMS: tl.constexpr,
        W: tl.constexpr,
        PACKED: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_DIMS: tl.constexpr,
    ):
        """Program (batch row · KV head, block of BLOCK_K keys): the block's codes, every sub-space of every key."""
        head = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_m = tl.arange(0, BLOCK_M)
        offs_e = tl.arange(0, BLOCK_DIMS)
        m_ok = offs_m < M
        sub = offs_m[:, None] * DIMS + offs_e[None, :]  # [sub-space, dimension in it] → the head's dimension
        ok = (rows < N)[:, None, None] & (m_ok[:, None] & (offs_e < DIMS)[None, :])[None, :, :]
        x = tl.load(
            KEYS + (head // Hkv) * sk_b + (head % Hkv) * sk_h + rows[:, None, None] * sk_n + sub[None, :, :],
            mask=ok,
            other=0.0,
        ).to(tl.float32)
        code = nearest_code(x, CENT + head * M * C * DIMS, offs_m, m_ok, C, DIMS, BLOCK_DIMS)
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
        BLOCK_DIMS: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Program (batch row, KV head, sub-space): its k-means over the row's n training positions POS (CHOSEN
        first: the points; the rest fill the row), the points in registers, the centroids in CENT's rows of the
        problem between rounds."""
        pid = tl.program_id(0).to(tl.int64)
        bh = pid // M
        b = bh // Hkv
        base = KEYS + b * sk_b + (bh % Hkv) * sk_h + (pid % M) * DIMS
        OWN = CENT + pid * C * DIMS  # the problem's centroids [C, DIMS]
        offs_e = tl.arange(0, BLOCK_DIMS)
        e_ok = offs_e < DIMS
        offs = tl.arange(0, BLOCK_N)
        in_n = offs < n
        pos = tl.load(POS + b * n + offs, mask=in_n, other=0)
        weight = tl.load(CHOSEN + b * n + offs, mask=in_n, other=0).to(tl.float32)
        x = tl.load(base + pos[:, None] * sk_n + offs_e[None, :], mask=in_n[:, None] & e_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        # The start: the chosen points at evenly spaced ranks, repeated where there are fewer than C.
        available = tl.sum((weight > 0).to(tl.int64), axis=0)
        for j in range(0, C):
            rank = tl.minimum((j * available) // C, tl.maximum(available - 1, 0))
            start = tl.load(POS + b * n + rank)
            tl.store(
                OWN + j * DIMS + offs_e,
                tl.load(base + start * sk_n + offs_e, mask=e_ok, other=0.0).to(tl.float32),
                mask=e_ok,
            )
        zero = tl.zeros([1], tl.int64)
        for _round in range(iterations):
            tl.debug_barrier()  # the centroids stored, for every thread to read
            code = tl.reshape(nearest_code(x[:, None, :], OWN, zero, zero == 0, C, DIMS, BLOCK_DIMS), [BLOCK_N])
            tl.debug_barrier()  # every thread's reads done before the centroids change
            for j in range(0, C):
                member = (code == j) & (weight > 0)
                count = tl.sum(tl.where(member, weight, 0.0), axis=0)
                sums = tl.sum(tl.where(member[:, None], x, 0.0), axis=0)
                kept = tl.load(OWN + j * DIMS + offs_e, mask=e_ok, other=0.0)
                tl.store(OWN + j * DIMS + offs_e, tl.where(count > 0, sums / tl.maximum(count, 1.0), kept), mask=e_ok)
