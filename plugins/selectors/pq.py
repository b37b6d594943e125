"""PQS — product-quantised selection: every dimension of a key, a few bits for each.

QGS codes a key by its projection on a few directions (the context queries' and the keys' main ones); a query that
looks elsewhere — an answer's query on Gemma-3's 256-dimensional heads — scores a needle's key by what those
directions kept of it, and the needle misses the shortlist. Product quantisation (Jégou, Douze and Schmid, "Product
quantization for nearest neighbor search", TPAMI 2011) covers every dimension instead: a head's D dimensions are split
into M = D / ``dims`` sub-spaces; in each, 2^``bits`` centroids are learnt from the context's keys (k-means,
``oa_core.ops.kmeans``) and a key is coded by its nearest centroid's number. A query scores a key by table lookup,
z̃_i = s·Σ_m q_m·c_{m, code_im}, the table of q_m·c_{m,j} made once per query: the score's error is
s·Σ_m q_m·(k_im − c_{m, code_im}), within s·Σ_m ‖q_m‖·‖k_im − c_{m, code_im}‖ whatever the query. The tables' entries
are rounded to float16 (``half_tables``; the sums stay float32), alike on every path, so that each reads the same rows
and the GPU's shortlist (``plugins/kernels/pq_shortlist.cu``) may hold two query heads' entries in one 32-bit word of
shared memory, half its lookups (docs/results.md says where that stands). The rounding moves an entry by at most 2^-11
of it, far inside the codes' error: on both offline models the shortlists keep the rows of float32 tables
(``benchmarks/studies/shared_shortlist_recall.py``).

The default, 16 centroids of each pair of dimensions, reads D/4 bytes per key (two 4-bit codes a byte, as the index
keeps them): 1/16 of a
key and value in bf16 on every head size, the scoring bytes following the head rather than a constant. The
shortlist's best ``rerank`` × budget rows are re-scored from their keys, as QGS's (``oa_core.ops.rerank``).

On CUDA tensors (and on CPU tensors under ``TRITON_INTERPRET=1``) ``score`` is one Triton kernel after the tables
(``group_lut_scores``); elsewhere the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Clusters, Selector
from oa_core.ops import triton_path
from oa_core.ops.geometry import on_gpu
from oa_core.ops.kmeans import lloyd_iterations, nearest
from oa_core.ops.rerank import ExactRerank
from oa_core.ops.triton_path import tl, triton
from oa_plugins.selectors.pq_programs import encode_triton, fits, train_triton


class PQSConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dims: int = Field(default=2, ge=1, description="dimensions per sub-space: D / dims codes per key")
    bits: Literal[4, 8] = Field(default=4, description="bits per code: 2^bits centroids per sub-space")
    iterations: int = Field(default=8, ge=0, description="Lloyd iterations of each sub-space's k-means")
    train: int = Field(
        default=4096,
        ge=256,
        description="keys per (batch row, KV head) the centroids are learnt "
        "from, evenly spaced over the context (all of them when it has fewer); 1024 kept as many of exact top-k's "
        "rows on both offline models (benchmarks/studies/pq_training_recall.py) for a cheaper prepare",
    )
    rerank: float = Field(
        default=4.0,
        ge=0.0,
        description="shortlist re-ranked by exact logits, in multiples of the "
        "selectable budget (0: the codes' scores alone)",
    )


# Keys per program of the table-lookup scores: 128 at 4 warps was the fastest launch on an H100 (within 2% of the
# best, per head and shared: ``benchmarks/studies/results/lut_scores_sweep_h100.json``) — fewer where a thread would
# hold more than LUT_CODES of the block's codes (``lut_block``).
LUT_BLOCK = 128
LUT_CODES = 64
HALF_MAX = 65504.0  # float16's largest finite value: the tables saturate there instead of overflowing to inf


@dataclass
class PQSIndex:
    centroids: Tensor  # [B, Hkv, M, 2^bits, dims] float32
    codes: Tensor  # [B, Hkv, N, W] uint8: 4-bit codes two a byte (W = ⌈M/2⌉, ``pack_codes``), 8-bit a byte (W = M)


def half_tables(tables: Tensor) -> Tensor:
    """Table entries q_m·c_{m,j} rounded to float16, to nearest (ties to even), saturating at ±``HALF_MAX``; float32."""
    return tables.float().clamp(-HALF_MAX, HALF_MAX).half().float()


def packed(centroids: int) -> bool:
    """Whether the codes of sub-spaces of ``centroids`` centroids are kept two a byte (at most 16: 4 bits)."""
    return centroids <= 16


def code_block(sub_spaces: int) -> int:
    """The Triton programs' block of a key's codes (``load_codes``): the sub-spaces rounded up to a power of two, at
    least 2 — for packed codes, twice the bytes' block."""
    return 1 << max(1, (sub_spaces - 1).bit_length())


def lut_block(sub_spaces: int, warps: int) -> int:
    """Keys per program of a table-lookup score kernel: LUT_BLOCK, halved while a thread of ``warps`` warps would
    hold more than LUT_CODES codes of the block (at head dim 256, 128 keys a program at 2 warps spilled 13 KB a
    thread to the stack: ``benchmarks/studies/kernel_resources.py``), at least 16."""
    block = LUT_BLOCK
    while block > 16 and block * code_block(sub_spaces) > LUT_CODES * 32 * warps:
        block //= 2
    return block


def pack_codes(codes: Tensor) -> Tensor:
    """4-bit codes ``[..., M]`` uint8 → ``[..., ⌈M/2⌉]`` uint8: sub-space 2j in byte j's low nibble, 2j + 1 in its high
    one (0 past M)."""
    if codes.shape[-1] % 2:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], 1)], dim=-1)
    pairs = codes.view(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def unpack_codes(codes: Tensor, sub_spaces: int) -> Tensor:
    """``pack_codes``' inverse: ``[..., ⌈M/2⌉]`` → ``[..., M]`` uint8, M = ``sub_spaces``."""
    return torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)[..., :sub_spaces]


def sub_spaces(keys: Tensor, dims: int) -> Tensor:
    """keys ``[B, Hkv, N, D]`` → ``[B, Hkv, M, N, dims]`` float32, M = D / dims (a view's copy)."""
    B, Hkv, N, D = keys.shape
    return keys.float().reshape(B, Hkv, N, D // dims, dims).permute(0, 1, 3, 2, 4).contiguous()


def encode(keys: Tensor, centroids: Tensor) -> Tensor:
    """keys ``[B, Hkv, N, D]``, centroids ``[B, Hkv, M, C, dims]`` → codes ``[B, Hkv, N, W]`` uint8: each sub-space's
    nearest centroid, packed two a byte where C ≤ 16 (``PQSIndex``). On CUDA tensors one Triton launch."""
    dims, count = centroids.shape[-1], centroids.shape[-2]
    if on_gpu(keys):
        return encode_triton(keys, centroids, packed(count))
    codes = nearest(sub_spaces(keys, dims), centroids).to(torch.uint8).transpose(-1, -2).contiguous()
    return pack_codes(codes) if packed(count) else codes


def training_positions(region: Tensor, most: int) -> tuple[Tensor, Tensor]:
    """region ``[B, N]`` → (the positions of the keys the centroids are learnt from ``[B, n]``, which of them are
    such keys ``[B, n]``), n = min(``most``, N): every k-th key of the region, k = ⌈its size / most⌉, in order
    (deterministic, spread over the whole context); a row with fewer fills its end with other positions, not chosen."""
    stride = (region.sum(-1, keepdim=True) + most - 1) // most
    chosen = region & ((region.cumsum(-1) - 1) % stride.clamp_min(1) == 0)
    positions = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)[:, : min(most, region.shape[-1])]
    return positions, chosen.gather(-1, positions)


def initial_centroids(points: Tensor, weight: Tensor, count: int) -> Tensor:
    """points ``[P, n, dims]`` whose chosen ones (``weight`` > 0) come first → ``count`` starting centroids ``[P,
    count, dims]``: the chosen points at evenly spaced ranks (repeated where there are fewer). No draw, no
    k-means++: its sequential passes cost more than the Lloyd iterations that follow."""
    available = (weight > 0).sum(-1, keepdim=True)  # [P, 1]
    ranks = (torch.arange(count, device=points.device) * available) // count
    picked = ranks.clamp_max((available - 1).clamp_min(0))  # [P, count]
    return points.gather(1, picked[..., None].expand(*picked.shape, points.shape[-1]))


def learn_centroids(keys: Tensor, positions: Tensor, chosen: Tensor, dims: int, count: int, iterations: int) -> Tensor:
    """Each sub-space's ``count`` centroids ``[B, Hkv, D / dims, count, dims]`` by k-means over the training keys at
    ``positions`` (``chosen``: the points; ``training_positions``), from ``initial_centroids``, on the shared k-means
    (``lloyd_iterations``); ``pq_programs.train_triton`` is the same in one GPU launch."""
    B, Hkv, _, D = keys.shape
    M, n = D // dims, positions.shape[-1]
    points = sub_spaces(keys.gather(2, positions[:, None, :, None].expand(B, Hkv, n, D)), dims).reshape(-1, n, dims)
    weight = chosen[:, None, None, :].expand(B, Hkv, M, n).reshape(-1, n).float()
    _, centroids = lloyd_iterations(points, weight, initial_centroids(points, weight, count), iterations)
    return centroids.view(B, Hkv, M, count, dims)


class ProductQuantisedSelector(ExactRerank, Selector):
    """PQS: a code per sub-space of every key, scored by table lookup (then the shortlist by exact logits)."""

    name = "pq"
    Config = PQSConfig
    config: PQSConfig

    def build(
        self, keys: Tensor, queries: Tensor | None, clusters: Clusters, generator: torch.Generator | None = None
    ) -> PQSIndex:
        D, dims = keys.shape[-1], self.config.dims
        if D % dims:
            raise ValueError(f"selector 'pq': dims {dims} does not divide the head dim {D}; pick a divisor of {D}")
        count = 2**self.config.bits
        positions, chosen = training_positions(clusters.assignment[:, 0] < clusters.num_clusters, self.config.train)
        learn = train_triton if on_gpu(keys) and fits(positions.shape[-1], dims) else learn_centroids
        centroids = learn(keys, positions, chosen, dims, count, self.config.iterations)
        return PQSIndex(centroids, encode(keys, centroids))

    def scoring_bytes(self, head_dim: int) -> float:
        return head_dim / self.config.dims * self.config.bits / 8  # a code per sub-space

    def token_codes(self, index: PQSIndex, keys: Tensor) -> dict[str, Tensor]:
        return {"codes": encode(keys, index.centroids)}

    def score(self, query: Tensor, index: PQSIndex, keys: Tensor, scale: float) -> Tensor:
        B, Hkv, Gs, G, T, D = query.shape
        M, C, dims = index.centroids.shape[2:]
        sub = query.float().reshape(B, Hkv, Gs * G * T, M, dims)  # rows (selection head, query head, query)
        # q_m·c_{m,j}, rounded to float16: [B, Hkv, rows, M, C]
        tables = half_tables(torch.einsum("bhrmd,bhmcd->bhrmc", sub, index.centroids))
        if triton_path.unavailable_reason(query.device) is None and scale > 0:
            return group_lut_scores(tables, index.codes, scale, T, G).view(B, Hkv, Gs, T, -1)
        # Each key a bag of its M table entries (head h's sub-space m's code j at (h·M + m)·C + j), summed by one
        # embedding_bag over the codes of every (batch row, KV head), not a gather of rows × N × M entries.
        codes = unpack_codes(index.codes, M) if packed(C) else index.codes
        N, rows = codes.shape[2], tables.shape[2]
        place = C * torch.arange(B * Hkv * M, device=query.device).view(B * Hkv, 1, M)
        offsets = (codes.long().view(B * Hkv, N, M) + place).view(-1, M)  # [B·Hkv·N, M]
        entries = tables.reshape(B * Hkv, rows, M * C).transpose(1, 2).reshape(-1, rows)  # [B·Hkv·M·C, rows]
        sums = F.embedding_bag(offsets, entries, mode="sum").view(B * Hkv, N, rows)
        scores = scale * sums.transpose(1, 2).reshape(B, Hkv, Gs, G, T, N)
        return scores.amax(3)


def group_lut_scores(
    tables: Tensor,
    codes: Tensor,
    scale: float,
    queries: int,
    group: int,
    *,
    block_n: int | None = None,
    num_warps: int = 4,
    out: Tensor | None = None,
) -> Tensor:
    """The selection scores in one pass over the codes: tables ``[B, Hkv, g·T, M, C]`` float32 (``half_tables``'s,
    as the selector makes them; rows ordered (head in the KV group, query), T = ``queries``), codes
    ``[B, Hkv, N, W]`` uint8 (``PQSIndex``), ``scale`` s > 0; ``group``: the heads that share one selection →
    ``[B, Hkv, Gs·T, N]`` float32 (Gs = g/group; into ``out``, contiguous, where given): s·max over the selection
    head's group of Σ_m table[m, code_m]. Launches one kernel and waits for nothing."""
    B, Hkv, Q, M, C = tables.shape
    N, W = codes.shape[2:]
    pack = packed(C)
    if ((M + 1) // 2 if pack else M) != W:
        raise ValueError(f"group_lut_scores: {W} code bytes per key for {M} sub-spaces of {C} centroids")
    rows = Q // group
    if out is None:
        out = torch.empty(B, Hkv, rows, N, device=tables.device, dtype=torch.float32)
    elif out.shape != (B, Hkv, rows, N) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"group_lut_scores: out must be a contiguous float32 [{B}, {Hkv}, {rows}, {N}] tensor")
    if out.numel() == 0:
        return out
    block_n = block_n or min(lut_block(M, num_warps), max(16, triton.next_power_of_2(N)))
    num_blocks = triton.cdiv(N, block_n)
    _group_lut_scores[(B * Hkv * num_blocks,)](
        tables.contiguous(),
        codes.contiguous(),
        out,
        N,
        queries,
        rows,
        num_blocks,
        scale,
        G=group,
        M=M,
        C=C,
        W=W,
        PACKED=pack,
        BLOCK_M=code_block(M),
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out


if triton is not None:

    @triton.jit
    def load_codes(CODES, offs, in_n, W, M, PACKED: tl.constexpr, BLOCK_M: tl.constexpr):
        """The codes of the positions ``offs`` (``in_n``: those that exist; CODES: the (batch row, KV head)'s first
        position, W bytes each) → ``[len(offs), BLOCK_M]`` int32 in sub-space order, 0 past M. PACKED: two codes a
        byte, byte j's low nibble sub-space 2j's and its high one 2j + 1's (``pack_codes``)."""
        if PACKED:
            offs_w = tl.arange(0, BLOCK_M // 2)
            raw = tl.load(
                CODES + offs[:, None] * W + offs_w[None, :], mask=in_n[:, None] & (offs_w[None, :] < W), other=0
            ).to(tl.int32)
            codes = tl.interleave(raw & 15, raw >> 4)
        else:
            offs_m = tl.arange(0, BLOCK_M)
            codes = tl.load(
                CODES + offs[:, None] * W + offs_m[None, :], mask=in_n[:, None] & (offs_m[None, :] < M), other=0
            ).to(tl.int32)
        return codes

    @triton.jit
    def lut_sums(TABLE, codes_t, both_t, M, C: tl.constexpr, BLOCK_M: tl.constexpr):
        """Σ_m TABLE[m, code_m] for a block of keys: TABLE one query head's table ``[M, C]``, held in registers and
        gathered by the block's codes transposed, ``codes_t`` ``[BLOCK_M, BLOCK_N]`` (``both_t``: the codes that
        exist) → ``[BLOCK_N]`` float32. (Gathers from memory, an address per code, took 1.3× as long at 16 × 16K on
        an H100: ``benchmarks/studies/results/lut_scores_sweep_h100.json``.)"""
        offs_m = tl.arange(0, BLOCK_M)
        entries = tl.load(TABLE + offs_m[:, None] * C + tl.arange(0, C)[None, :], mask=(offs_m < M)[:, None], other=0.0)
        return tl.sum(tl.where(both_t, tl.gather(entries, codes_t, axis=1), 0.0), axis=0)

    @triton.jit
    def _group_lut_scores(
        TABLES,
        CODES,
        OUT,
        N,
        T,
        ROWS,
        num_blocks,
        scale,
        G: tl.constexpr,
        M: tl.constexpr,
        C: tl.constexpr,
        W: tl.constexpr,
        PACKED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One program per (batch row, KV head, block of BLOCK_N tokens): the block's codes ``[BLOCK_N, M]`` stay in
        registers while each of the ROWS output rows (selection head · T + query) takes the maximum over its G query
        heads of that head's table entries summed over the M sub-spaces (``lut_sums``)."""
        pid = tl.program_id(0)
        head = (pid // num_blocks).to(tl.int64)
        offs_n = (pid % num_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        in_n = offs_n < N
        both_t = tl.trans(in_n[:, None] & (offs_m[None, :] < M))
        codes_t = tl.trans(load_codes(CODES + head * N * W, offs_n, in_n, W, M, PACKED, BLOCK_M))
        for row in range(0, ROWS):
            s = (row // T).to(tl.int64)
            t = (row % T).to(tl.int64)
            best = tl.full([BLOCK_N], float("-inf"), tl.float32)
            for j in range(G):
                table = TABLES + (head * (ROWS * G) + (s * G + j) * T + t) * (M * C)
                best = tl.maximum(best, lut_sums(table, codes_t, both_t, M, C, BLOCK_M))
            tl.store(OUT + (head * ROWS + row) * N + offs_n, best * scale, mask=in_n)


@hookimpl
def register_selectors(register):
    register(ProductQuantisedSelector)
