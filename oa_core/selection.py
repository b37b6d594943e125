"""Per-cluster top-q_b selection on the GPU without sorting the context (DESIGN.md §1 step 6).

The torch reference (``Selector.select``) sorts every row's N scores twice. Here each (selection row, cluster)
program reads only its cluster's scores, through ``members`` — the clusters' positions, cluster-major, built once
per prepare/append — and finds the q_b-th largest score exactly by bisection on the scores' order-preserving 32-bit
keys (at most 32 counts over the cluster held in registers, fewer when a count hits q_b exactly; a cluster larger
than 4096 is re-read from cache a block at a time). It writes the positions scoring above it, then the positions
tied with it in position order until q_b are taken: the same set as the reference's stable sort (score descending,
position ascending), listed per cluster in position order.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


REGISTER_LIMIT = 4096  # the largest cluster held in registers at once; larger ones go a block of this size at a time


def cluster_members(assignment: Tensor, num_clusters: int) -> tuple[Tensor, Tensor]:
    """assignment ``[B, H, N]`` (``num_clusters`` outside the clusters) → (members ``[B, H, C, S]`` int32: each
    cluster's positions in order, -1 padded, S the largest cluster; counts ``[B, H, C]``)."""
    B, H, N = assignment.shape
    C = num_clusters
    counts = torch.zeros(B, H, C + 1, dtype=torch.long, device=assignment.device)
    counts.scatter_add_(-1, assignment, torch.ones_like(assignment))
    order = assignment.argsort(dim=-1, stable=True)  # positions grouped by cluster, in position order
    cluster = assignment.gather(-1, order)
    slot = torch.arange(N, device=assignment.device) - (counts.cumsum(-1) - counts).gather(-1, cluster)
    size = max(int(counts[..., :C].max()) if C else 0, 1)
    flat = torch.full((B, H, C * size + 1), -1, dtype=torch.int32, device=assignment.device)
    inside = cluster < C
    flat.scatter_(-1, (cluster * size + slot).masked_fill(~inside, C * size),
                  order.masked_fill(~inside, -1).to(torch.int32))
    return flat[..., :C * size].reshape(B, H, C, size).contiguous(), counts[..., :C].contiguous()


if triton is not None:

    @triton.jit
    def _order_key(score):
        """float32 → int32 with the same order (negative floats' magnitude bits flipped)."""
        bits = score.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _cluster_keys(members, scores, start, n, BLOCK: tl.constexpr):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        pos = tl.load(members + offs, mask=ok, other=0)
        key = _order_key(tl.load(scores + pos, mask=ok, other=0.0))
        return pos, key, ok

    @triton.jit
    def take_top(pos, key, ok, quota, n, out):
        """A cluster held in registers — positions ``pos``, order keys ``key``, lanes ``ok`` (n of them) — → its
        ``quota`` best positions written to ``out`` in position order (ties at the threshold by position)."""
        # τ: the largest key with count(key ≥ τ) ≥ quota; the invariant holds at lo = −2^31, never at 2^31.
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483648, tl.int64)
        above_lo = n  # count(key ≥ lo); the search ends early once it is exactly the quota
        while (hi - lo > 1) & (above_lo > quota):
            mid = lo + (hi - lo) // 2
            count = tl.sum(((key >= mid.to(tl.int32)) & ok).to(tl.int32), axis=0)
            lo = tl.where(count >= quota, mid, lo)
            above_lo = tl.where(count >= quota, count, above_lo)
            hi = tl.where(count >= quota, hi, mid)
        tau = lo.to(tl.int32)
        tie = ok & (key == tau)
        ties_left = quota - tl.sum(((key > tau) & ok).to(tl.int32), axis=0)
        keep = ok & ((key > tau) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) - 1 < ties_left)))
        tl.store(out + tl.cumsum(keep.to(tl.int32), axis=0) - 1, pos.to(tl.int64), mask=keep)

    @triton.jit
    def _select_kernel(SCORES, MEMBERS, COUNTS, QUOTAS, OFFSETS, OUT, N, C, S, WIDTH, ROWS_PER_HEAD,
                       BLOCK: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)  # selection row (batch row, KV head, selection head, query)
        c = tl.program_id(1)
        head = p // ROWS_PER_HEAD  # (batch row, KV head)
        quota = tl.load(QUOTAS + p * C + c)
        n = tl.load(COUNTS + head * C + c)
        out = OUT + p * WIDTH + tl.load(OFFSETS + p * C + c)
        members = MEMBERS + (head * C + c) * S
        scores = SCORES + p * N
        if quota > 0:
            if n <= BLOCK:  # the whole cluster in registers: one gather, then counts over registers
                pos, key, ok = _cluster_keys(members, scores, 0, n, BLOCK)
                take_top(pos, key, ok, quota, n, out)
            else:  # a cluster larger than a block: the same, a block at a time (re-read from cache)
                lo = tl.full([], -2147483648, tl.int64)
                hi = tl.full([], 2147483648, tl.int64)
                above_lo = n
                while (hi - lo > 1) & (above_lo > quota):
                    mid = lo + (hi - lo) // 2
                    count = tl.zeros([], tl.int32)
                    for start in range(0, n, BLOCK):
                        pos, key, ok = _cluster_keys(members, scores, start, n, BLOCK)
                        count += tl.sum(((key >= mid.to(tl.int32)) & ok).to(tl.int32), axis=0)
                    lo = tl.where(count >= quota, mid, lo)
                    above_lo = tl.where(count >= quota, count, above_lo)
                    hi = tl.where(count >= quota, hi, mid)
                tau = lo.to(tl.int32)
                above = tl.zeros([], tl.int32)
                for start in range(0, n, BLOCK):
                    pos, key, ok = _cluster_keys(members, scores, start, n, BLOCK)
                    above += tl.sum(((key > tau) & ok).to(tl.int32), axis=0)
                # Above τ: all; at τ: the first ones in position order until quota.
                ties_left = quota - above
                written = tl.zeros([], tl.int32)
                for start in range(0, n, BLOCK):
                    pos, key, ok = _cluster_keys(members, scores, start, n, BLOCK)
                    tie = ok & (key == tau)
                    keep = ok & ((key > tau) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) - 1 < ties_left)))
                    tl.store(out + written + tl.cumsum(keep.to(tl.int32), axis=0) - 1, pos.to(tl.int64), mask=keep)
                    written += tl.sum(keep.to(tl.int32), axis=0)
                    ties_left -= tl.sum((tie & keep).to(tl.int32), axis=0)


def select_per_cluster(scores: Tensor, members: Tensor, counts: Tensor, quotas: Tensor, width: int) -> Tensor:
    """scores ``[B, Hkv, Gs, T, N]``, members/counts from ``cluster_members``, quotas ``[B, Hkv, Gs, T, C]`` (each
    q_b ≤ n_b, Σ_b q_b ≤ width) → positions ``[B, Hkv, Gs, T, width]``, -1 padded."""
    B, Hkv, Gs, T, N = scores.shape
    C, S = members.shape[-2:]
    rows = B * Hkv * Gs * T
    quotas = quotas.reshape(rows, C).long().contiguous()
    offsets = (quotas.cumsum(-1) - quotas).contiguous()
    out = torch.full((rows, max(width, 1)), -1, dtype=torch.long, device=scores.device)
    if rows and C:
        block = min(triton.next_power_of_2(S), REGISTER_LIMIT)
        _select_kernel[(rows, C)](scores.float().reshape(rows, N).contiguous(), members, counts, quotas, offsets,
                                  out, N, C, S, out.shape[-1], Gs * T, BLOCK=block,
                                  num_warps=max(4, min(8, block // 512)))
    return out[:, :width].view(B, Hkv, Gs, T, width)
