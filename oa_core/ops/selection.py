"""Per-cluster top-q_b selection (docs/design.md, step 6): inside each cluster b, the q_b positions of highest score.

``select`` is the entry: on CUDA tensors the Triton kernel below (``select_per_cluster``), on CPU tensors its C++
counterpart (``oa_core.ops.native``: each cluster's threshold by ``std::nth_element``, compiled at first use);
``select_by_sorting`` is the torch reference they are tested against, and what runs where neither can. All of them
list the same positions in the same order.

The torch reference sorts every row's N scores twice. Here each (selection row, cluster)
program reads only its cluster's scores, through ``members`` — the clusters' positions, cluster-major, built at
prepare and extended by growth — and takes its q_b best on the scores' order-preserving 32-bit keys. Up to
``FEW_PICKS`` are picked one at a time: each pick is one max-reduction over (key, lane) packed in 64 bits, so the
largest key and the first position among its ties come together; the picks' positions are then written in position
order. A larger quota is found by bisection for the q_b-th largest key, between the cluster's smallest and largest
(at most 32 counts over the cluster held in registers, fewer when a count hits q_b exactly), then the positions above
it and those tied with it in position order until q_b are taken. Either way: the same set as the reference's stable
sort (score descending, position ascending), listed per cluster in position order. A cluster whose quota covers it is
copied without reading scores.

Clusters are ragged (the largest a few times the mean), so one block sized for the largest would run every count over
its size. Instead a launch covers a size class and holds two paths: (0, 2s] with blocks of s and 2s lanes, where s is
the power of two at or above a typical cluster's size, at most ``SMALL_CLUSTER`` (``smallest_block``), then classes
four times wider up to ``REGISTER_LIMIT``, then everything larger a block at a time; a program takes the smaller block
when its cluster fits it, and ends at once when its cluster is not in the launch's class. The classes launched follow
from the largest cluster, which the host knows from ``members``' shape: nothing waits on the device (CUDA-graph
capturable).

Why this shape: a program's cost is latency, not bytes. One launch with two paths instead of one launch per block
size gained most (``benchmarks/kernel_h200.py``). A cluster's members lie anywhere in the context, so each 4-byte
score read costs its 32-byte sector; the grid puts a row's clusters next to each other, so that the rest of each
sector, which the row's other clusters read, is still in L2 when they do (the selection 1.9× faster at 32 × 32K than
with a cluster's programs for every row first). Reading the scores in member order instead then gains nothing
(``benchmarks/studies/select_layout.py``); scoring a cluster's codes inside the selection gained little (earlier).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oa_core.ops import native, triton_path
from oa_core.ops.scatter import count_by_slot, positions
from oa_core.ops.triton_path import tl, triton

# The smallest block's upper bound (a power of two): a typical cluster at 64 clusters of 32K tokens. Smaller typical
# clusters get a smaller block (``smallest_block``): at 64 clusters of 16K tokens (about 255 rows each) 256 lanes
# instead of 512 took the selection from 35 to 30 µs at 3% on the H200; at 32K tokens 256 lanes were 20-50% slower.
SMALL_CLUSTER = 512
REGISTER_LIMIT = 4096  # the largest cluster held in registers at once; larger ones go a block of this size at a time
FEW_PICKS = 16  # quotas up to this are picked one at a time (a power of two: the picks' lanes are held in a block)
MAX_BOXED = 2**23 - 2  # the most shortlist entries a boxed score can name (``listed_box``: a NaN's payload, 23 bits)


def select(
    scores: Tensor,
    assignment: Tensor,
    quotas: Tensor,
    width: int | None = None,
    members: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """scores ``[B, Hkv, Gs, T, N]`` (-inf outside the clusters), assignment ``[B, Hkv, N]`` (C outside), quotas
    ``[B, Hkv, Gs, T, C]`` (q_b ≤ n_b) → positions ``[B, Hkv, Gs, T, K]``: each cluster's q_b best as one run in
    position order, clusters in order, then -1 padding; the same on every path. Ties go to the earlier position.
    K = ``width`` (a bound on Σ_b q_b known on the host, so that nothing waits on the device; the pipeline's never
    passes N, and the CPU paths cut a wider one at N), or the largest Σ_b q_b when None. ``members``
    (``cluster_members``) and a width: the Triton kernel on CUDA tensors, the compiled C++ one on CPU tensors
    (``oa_core.ops.native``; tests run the Triton kernel on the CPU under ``TRITON_INTERPRET=1``); ``select_by_sorting``
    otherwise."""
    if members is not None and width is not None:
        if scores.is_cuda and triton_path.unavailable_reason(scores.device) is None:
            return select_per_cluster(scores, *members, quotas, width)
        if scores.device.type == "cpu" and native.library() is not None:
            return native.select_per_cluster(scores, *members, quotas, width)
    return select_by_sorting(scores, assignment, quotas, width)


def select_by_sorting(scores: Tensor, assignment: Tensor, quotas: Tensor, width: int | None = None) -> Tensor:
    """``select`` in torch, the reference: one stable sort by (cluster, score descending), so that each cluster's
    positions form one run, best first (ties: the earlier position); the first q_b of each run are kept, then listed
    cluster by cluster in position order."""
    num_tokens = scores.shape[-1]
    num_clusters = quotas.shape[-1]
    cluster = assignment[:, :, None, None, :].expand_as(scores)
    # int64 keys: the cluster in the high half, the score's order reversed in the low (0 for the best float32).
    ranked = ((cluster << 32) + (2**31 - 1 - order_keys(scores))).argsort(dim=-1, stable=True)
    cluster = cluster.gather(-1, ranked)
    sizes = count_by_slot(assignment, num_clusters)
    starts = (sizes.cumsum(-1) - sizes)[:, :, None, None, :].expand(*scores.shape[:-1], -1)
    starts = torch.cat([starts, starts.new_zeros(*starts.shape[:-1], 1)], -1)  # slot C: outside, never taken
    rank = torch.arange(num_tokens, device=scores.device) - starts.gather(-1, cluster)
    quota = torch.cat([quotas, torch.zeros_like(quotas[..., :1])], dim=-1).gather(-1, cluster)
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, ranked, rank < quota)  # by position
    by_cluster = assignment.argsort(dim=-1, stable=True)[:, :, None, None, :].expand_as(scores)
    taken = positions(kept.gather(-1, by_cluster), width)
    return by_cluster.gather(-1, taken.clamp_min(0)).masked_fill(taken < 0, -1)


def order_keys(scores: Tensor) -> Tensor:
    """float32 scores → int64 keys in [-(2^31 - 1), 2^31 - 1] in the same order (the bits, negated magnitude for
    negative floats: -0.0 and 0.0 tie, as they compare), as the Triton kernel's ``order_key``."""
    bits = scores.float().contiguous().view(torch.int32)
    return ((bits & 0x7FFFFFFF) * ((bits >> 31) | 1)).long()  # the magnitude, times -1 where the sign bit is set


def unique_keys(scores: Tensor) -> Tensor:
    """float32 scores ``[..., N]`` → int64 keys, none tied, in the order of a stable descending sort: ``order_keys``
    in the high half, the position reversed in the low half (at equal scores the earlier position is larger)."""
    n = scores.shape[-1]
    return (order_keys(scores) << 32) + (n - 1 - torch.arange(n, device=scores.device))


def best_of(scores: Tensor, k: int, counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The ``k`` best of ``scores`` ``[..., N]`` float32 along the last dim, as a set, each row's ``counts`` best
    marked → (their scores, their positions, ``kept``: among the row's ``counts`` best (``counts`` broadcasts to
    ``[..., 1]``, each ≤ k) and finite), each ``[..., k]``. The set and the marks are the first k and first counts
    columns of a stable descending sort (score descending, then position ascending); the columns' order is not
    (sorted where some row keeps fewer than k and on the GPU, where a sorted top-k costs about the same).

    A top-k over ``unique_keys``, so that any top-k is that set. Unsorted and cut at the least key where every row
    keeps k, its usual case: on 2 CPU cores at N = 4096 a sorted top-k of 1,556 takes 0.32 ms, an unsorted one 0.03
    (and a sort of the 1,556 0.39: the CPU checks whether a row keeps fewer, which costs it no wait)."""
    k = min(k, scores.shape[-1])
    if k <= 0:
        none = scores[..., :0]
        return none, none.long(), none > 0
    keys = unique_keys(scores)
    ordered = scores.device.type != "cpu" or bool((counts < k).any())
    top_keys, top = keys.topk(k, dim=-1, sorted=ordered)
    if ordered:  # each row's count-th key
        cut = top_keys.gather(-1, (counts - 1).clamp(0, k - 1).expand(*top.shape[:-1], 1))
    else:
        cut = top_keys.amin(-1, keepdim=True)
    values = scores.gather(-1, top)
    return values, top, (top_keys >= cut) & (counts > 0) & (values > float("-inf"))


def top_counts(
    scores: Tensor, assignment: Tensor, budget: Tensor, num_clusters: int, width: int | None = None
) -> Tensor:
    """How many of each row's ``budget`` ``[B, Hkv, 1, 1]`` best ``scores`` ``[B, Hkv, Gs, T, N]`` (-inf: none) fall
    in each cluster of ``assignment`` ``[B, Hkv, N]`` → ``[B, Hkv, Gs, T, C]``. ``width``: a bound of the budget known
    on the host (None: read from it, a device sync)."""
    width = min(width if width is not None else int(budget.max()), scores.shape[-1])
    _, top, kept = best_of(scores, width, budget[..., None])  # ties (a Quest page): the earliest positions
    assignment = assignment[:, :, None, None, :].expand_as(scores)
    return count_by_slot(assignment.gather(-1, top).masked_fill(~kept, num_clusters), num_clusters)


def cluster_members(assignment: Tensor, num_clusters: int, room: int = 0) -> tuple[Tensor, Tensor]:
    """assignment ``[B, H, N]`` (``num_clusters`` outside the clusters) → (members ``[B, H, C, S]`` int32: each
    cluster's positions in order, -1 padded; counts ``[B, H, C]``). S: the largest cluster plus ``room`` slots for
    growth (``add_members``)."""
    B, H, N = assignment.shape
    C = num_clusters
    counts = torch.zeros(B, H, C + 1, dtype=torch.long, device=assignment.device)
    counts.scatter_add_(-1, assignment, torch.ones_like(assignment))
    order = assignment.argsort(dim=-1, stable=True)  # positions grouped by cluster, in position order
    cluster = assignment.gather(-1, order)
    slot = torch.arange(N, device=assignment.device) - (counts.cumsum(-1) - counts).gather(-1, cluster)
    size = max(int(counts[..., :C].max()) if C else 0, 1) + room
    flat = torch.full((B, H, C * size + 1), -1, dtype=torch.int32, device=assignment.device)
    inside = cluster < C
    flat.scatter_(
        -1, (cluster * size + slot).masked_fill(~inside, C * size), order.masked_fill(~inside, -1).to(torch.int32)
    )
    return flat[..., : C * size].reshape(B, H, C, size).contiguous(), counts[..., :C].contiguous()


def add_members(members: Tensor, counts: Tensor, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """``cluster_members``' table and counts with the positions ``[t]`` (later than every listed one) added to the
    clusters ``ids`` ``[B, H, t]`` (C: none), in a copy; the caller makes sure every cluster has room. The table is
    a view of a buffer with one spare slot per (batch row, head): not contiguous (``select_per_cluster`` takes its
    head stride)."""
    B, H, C, S = members.shape
    inside = ids < C
    cluster = ids.clamp_max(C - 1)
    earlier = torch.ones(ids.shape[-1], ids.shape[-1], dtype=torch.bool, device=ids.device).tril(-1)
    rank = ((ids[..., :, None] == ids[..., None, :]) & earlier).sum(-1)  # among this step's same-cluster rows
    slot = (cluster * S + counts.gather(-1, cluster) + rank).masked_fill(~inside, C * S)
    flat = torch.cat([members.reshape(B, H, C * S), members.new_full((B, H, 1), -1)], dim=-1)
    flat.scatter_(-1, slot, positions.to(torch.int32).expand(ids.shape).masked_fill(~inside, -1))
    counts = counts.scatter_add(-1, cluster, inside.long())
    return flat[..., : C * S].reshape(B, H, C, S), counts


if triton is not None:

    @triton.jit
    def order_key(score):
        """float32 → int32 with the same order: the bits, negated magnitude for negative floats. So -0.0 and 0.0
        share a key (they tie in the reference's sort too), and every key is ≥ -(2^31 - 1)."""
        bits = score.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    @triton.jit
    def listed_box(entry):
        """Shortlist entry ``entry`` (int32, below 2^23 - 1) → the float32 NaN whose payload is entry + 1: what a
        listed position's score becomes, so that the selection reads its exact logit (``_cluster_keys``)."""
        return ((entry + 1) | 0x7F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _cluster_keys(members, scores, start, n, exact, shift, BOXED: tl.constexpr, BLOCK: tl.constexpr):
        """Positions, order keys and lanes of a cluster's block. BOXED: the scores of a two-stage selection, where a
        listed position holds its entry's box (``listed_box``: its key is its exact logit's, ``exact`` the row's
        shortlist) and every other is shifted below the shortlist by ``shift`` (``rerank_exact``'s arithmetic)."""
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        pos = tl.load(members + offs, mask=ok, other=0)
        score = tl.load(scores + pos, mask=ok, other=0.0)
        if BOXED:
            boxed = score != score
            entry = (score.to(tl.int32, bitcast=True) & 0x7FFFFF) - 1
            unlisted = tl.where(boxed, 0.0, score) + shift  # (a box's NaN left out of the sum)
            score = tl.where(boxed, tl.load(exact + entry, mask=ok & boxed, other=0.0), unlisted)
        return pos, order_key(score), ok

    @triton.jit
    def take_top(members, pos, key, ok, quota, n, out, BLOCK: tl.constexpr, FEW: tl.constexpr):
        """A cluster held in registers — positions ``pos`` (in position order, as listed at ``members``), order keys
        ``key`` (``order_key``), lanes ``ok`` (n of them) — → its ``quota`` best positions written to ``out`` in
        position order (ties by position). 0 < quota < n. Up to FEW are picked one at a time, more by bisection."""
        if quota <= FEW:
            _pick_best(members, key, ok, quota, out, BLOCK, FEW)
        else:
            keep = _keep_above_threshold(key, ok, quota, n)
            tl.store(out + tl.cumsum(keep.to(tl.int32), axis=0) - 1, pos.to(tl.int64), mask=keep)

    @triton.jit
    def _take_top_in_registers(
        members, scores, quota, n, out, exact, shift, BOXED: tl.constexpr, BLOCK: tl.constexpr, FEW: tl.constexpr
    ):
        pos, key, ok = _cluster_keys(members, scores, 0, n, exact, shift, BOXED, BLOCK)
        take_top(members, pos, key, ok, quota, n, out, BLOCK, FEW)

    @triton.jit
    def _pick_best(members, key, ok, quota, out, BLOCK: tl.constexpr, FEW: tl.constexpr):
        """The ``quota`` (≤ FEW) largest keys, one max-reduction each over (key, BLOCK - 1 - lane) packed in 64 bits:
        the largest key left and, among its ties, the first lane. Their positions go to ``out`` in lane order (a
        lane's slot: how many picked lanes precede it)."""
        lanes = tl.arange(0, BLOCK)
        # Keys are ≥ -(2^31 - 1), so -2^31 (lanes outside the cluster) never wins; a picked lane drops below it.
        packed = (tl.where(ok, key, -2147483648).to(tl.int64) << 32) | (-lanes + (BLOCK - 1)).to(tl.int64)
        slots = tl.arange(0, FEW)
        picked = tl.full([FEW], BLOCK, tl.int32)  # BLOCK: no pick (after every lane)
        for i in range(quota):
            top = tl.max(packed, axis=0)
            lane = (-(top & 0xFFFFFFFF) + (BLOCK - 1)).to(tl.int32)
            picked = tl.where(slots == i, lane, picked)
            packed = tl.where(lanes == lane, -9223372036854775807, packed)
        taken = slots < quota
        slot = tl.sum((picked[None, :] < picked[:, None]).to(tl.int32), axis=1)
        tl.store(out + slot, tl.load(members + picked, mask=taken, other=0).to(tl.int64), mask=taken)

    @triton.jit
    def _keep_above_threshold(key, ok, quota, n):
        """The lanes of the ``quota`` largest keys by bisection: every key above τ, then the first lanes tied at τ."""
        # τ: the largest key with count(key ≥ τ) ≥ quota; the invariant holds at the smallest key, never past the
        # largest. The search ends early once count(key ≥ lo) is exactly the quota.
        lo = tl.min(tl.where(ok, key, 2147483647), axis=0).to(tl.int64)
        hi = tl.max(tl.where(ok, key, -2147483647), axis=0).to(tl.int64) + 1
        above_lo = n
        while (hi - lo > 1) & (above_lo > quota):
            mid = lo + (hi - lo) // 2
            count = tl.sum(((key >= mid.to(tl.int32)) & ok).to(tl.int32), axis=0)
            lo = tl.where(count >= quota, mid, lo)
            above_lo = tl.where(count >= quota, count, above_lo)
            hi = tl.where(count >= quota, hi, mid)
        tau = lo.to(tl.int32)
        tie = ok & (key == tau)
        ties_left = quota - tl.sum(((key > tau) & ok).to(tl.int32), axis=0)
        return ok & ((key > tau) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) - 1 < ties_left)))

    @triton.jit
    def _take_top_blockwise(members, scores, quota, n, out, exact, shift, BOXED: tl.constexpr, BLOCK: tl.constexpr):
        """``take_top`` for a cluster larger than a block: each pass re-reads it a block at a time (from cache)."""
        lo = tl.full([], 2147483647, tl.int32)
        hi = tl.full([], -2147483647, tl.int32)
        for start in range(0, n, BLOCK):
            pos, key, ok = _cluster_keys(members, scores, start, n, exact, shift, BOXED, BLOCK)
            lo = tl.minimum(lo, tl.min(tl.where(ok, key, 2147483647), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(ok, key, -2147483647), axis=0))
        lo = lo.to(tl.int64)
        hi = hi.to(tl.int64) + 1
        above_lo = n
        while (hi - lo > 1) & (above_lo > quota):
            mid = lo + (hi - lo) // 2
            count = tl.zeros([], tl.int32)
            for start in range(0, n, BLOCK):
                pos, key, ok = _cluster_keys(members, scores, start, n, exact, shift, BOXED, BLOCK)
                count += tl.sum(((key >= mid.to(tl.int32)) & ok).to(tl.int32), axis=0)
            lo = tl.where(count >= quota, mid, lo)
            above_lo = tl.where(count >= quota, count, above_lo)
            hi = tl.where(count >= quota, hi, mid)
        tau = lo.to(tl.int32)
        above = tl.zeros([], tl.int32)
        for start in range(0, n, BLOCK):
            pos, key, ok = _cluster_keys(members, scores, start, n, exact, shift, BOXED, BLOCK)
            above += tl.sum(((key > tau) & ok).to(tl.int32), axis=0)
        # Above τ: all; at τ: the first ones in position order until quota.
        ties_left = quota - above
        written = tl.zeros([], tl.int32)
        for start in range(0, n, BLOCK):
            pos, key, ok = _cluster_keys(members, scores, start, n, exact, shift, BOXED, BLOCK)
            tie = ok & (key == tau)
            keep = ok & ((key > tau) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) - 1 < ties_left)))
            tl.store(out + written + tl.cumsum(keep.to(tl.int32), axis=0) - 1, pos.to(tl.int64), mask=keep)
            written += tl.sum(keep.to(tl.int32), axis=0)
            ties_left -= tl.sum((tie & keep).to(tl.int32), axis=0)

    @triton.jit
    def _select_kernel(
        SCORES,
        MEMBERS,
        COUNTS,
        QUOTAS,
        OFFSETS,
        OUT,
        EXACT,
        SHIFTS,
        N,
        C,
        S,
        HEAD_STRIDE,
        WIDTH,
        ROWS_PER_HEAD,
        LOW,
        HIGH,
        L,
        BLOCK: tl.constexpr,
        BLOCKWISE: tl.constexpr,
        FEW: tl.constexpr,
        BOXED: tl.constexpr,
    ):
        """One (selection row, cluster) program of the size class LOW < n ≤ HIGH (see the module's docstring).
        BOXED: a two-stage selection's scores (``_cluster_keys``), the rows' shortlists ``EXACT`` ``[rows, L]`` and
        shifts ``SHIFTS`` ``[rows]``."""
        # A row's clusters are neighbours in the grid: they read disjoint members of the same row's scores, whose
        # 32-byte sectors each hold several clusters' scores, and run close enough in time to find them in L2.
        program = tl.program_id(0).to(tl.int64)
        p = program // C  # selection row (batch row, KV head, selection head, query)
        c = program % C
        exact = EXACT + p * L
        shift = tl.load(SHIFTS + p) if BOXED else 0.0
        head = p // ROWS_PER_HEAD  # (batch row, KV head)
        n = tl.load(COUNTS + head * C + c)
        quota = tl.load(QUOTAS + p * C + c)  # loaded with n, not after the test: one wait instead of two
        first = tl.load(OFFSETS + p * C + c)
        if (n > LOW) & (n <= HIGH):
            out = OUT + p * WIDTH + first
            members = MEMBERS + head * HEAD_STRIDE + c * S
            if quota >= n:  # the whole cluster (often, for small ones): its positions as listed, no scores read
                for start in range(0, n, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    tl.store(out + offs, tl.load(members + offs, mask=offs < n).to(tl.int64), mask=offs < n)
            elif quota > 0:
                if BLOCKWISE:
                    _take_top_blockwise(members, SCORES + p * N, quota, n, out, exact, shift, BOXED, BLOCK)
                elif n <= BLOCK // 2:  # (each path in its own call: their tensors differ in shape)
                    _take_top_in_registers(members, SCORES + p * N, quota, n, out, exact, shift, BOXED, BLOCK // 2, FEW)
                else:
                    _take_top_in_registers(members, SCORES + p * N, quota, n, out, exact, shift, BOXED, BLOCK, FEW)


def smallest_block(typical: float) -> int:
    """The size classes' smallest block for clusters of about ``typical`` rows (their mean): the power of two at or
    above it — so that a typical cluster is held by the first class's smaller path —, at least 16 lanes and at most
    ``SMALL_CLUSTER``."""
    return min(SMALL_CLUSTER, max(16, 1 << max(math.ceil(typical) - 1, 0).bit_length()))


def size_classes(largest: int, small: int | None = None) -> list[tuple[int, int, int]]:
    """The launches for clusters of at most ``largest`` members: (low, high, block) per size class low < n ≤ high,
    with paths of block / 2 and block lanes in registers — (0, 2·small], then ×4 up to REGISTER_LIMIT —, then
    (REGISTER_LIMIT, largest] a block of REGISTER_LIMIT at a time. Only classes some cluster can fall in. ``small``:
    the smallest block (``smallest_block``), SMALL_CLUSTER when None."""
    classes, low, high = [], 0, min(2 * (small or SMALL_CLUSTER), REGISTER_LIMIT)
    while low < largest:
        if low >= REGISTER_LIMIT:
            classes.append((low, largest, REGISTER_LIMIT))
            break
        classes.append((low, high, high))
        low, high = high, min(4 * high, REGISTER_LIMIT)
    return classes


def _warps(block: int) -> int:
    """Warps per program of a launch whose largest block is ``block`` lanes: 2 for the classes up to 1024 lanes (the
    fastest in ``benchmarks/kernel_h200.py``), 8 above."""
    return 2 if block <= 1024 else 8


def select_per_cluster(scores: Tensor, members: Tensor, counts: Tensor, quotas: Tensor, width: int) -> Tensor:
    """scores ``[B, Hkv, Gs, T, N]``, members/counts from ``cluster_members``, quotas ``[B, Hkv, Gs, T, C]`` (each
    q_b ≤ n_b, Σ_b q_b ≤ width) → positions ``[B, Hkv, Gs, T, width]``, -1 padded. No host-device sync."""
    B, Hkv, Gs, T, N = scores.shape
    C, S = members.shape[-2:]
    if members.stride()[-2:] != (S, 1) or members.stride(0) != Hkv * members.stride(1):
        members = members.contiguous()  # the kernel reads (B, Hkv) rows a fixed stride apart, each C × S contiguous
    rows = B * Hkv * Gs * T
    quotas = quotas.reshape(rows, C).long().contiguous()
    offsets = (quotas.cumsum(-1) - quotas).contiguous()
    out = torch.full((rows, max(width, 1)), -1, dtype=torch.long, device=scores.device)
    if rows and C:  # N / C: about a cluster's size (the positions outside the clusters are a few)
        launch_select(
            scores.float().reshape(rows, N).contiguous(),
            members,
            counts.contiguous(),
            quotas,
            offsets,
            out,
            Gs * T,
            smallest_block(N / C),
        )
    return out[:, :width].view(B, Hkv, Gs, T, width)


def launch_select(
    scores: Tensor,
    members: Tensor,
    counts: Tensor,
    quotas: Tensor,
    offsets: Tensor,
    out: Tensor,
    rows_per_head: int,
    small: int | None = None,
    listing: tuple[Tensor, Tensor] | None = None,
) -> None:
    """``select_per_cluster``'s launches, one per size class: scores ``[rows, N]`` float32, members ``[B, Hkv, C, S]``
    (each head's C × S contiguous) and counts ``[B, Hkv, C]``, quotas ``[rows, C]``; cluster c of row p writes its
    q_b positions at ``out[p, offsets[p, c]:]`` (``out`` ``[rows, width]``, contiguous). ``rows_per_head``: the
    selection rows of one (batch row, KV head); ``small``: the smallest block (``smallest_block``). ``listing``: the
    scores are a two-stage selection's, boxed — each row's shortlist's exact logits ``[rows, L]`` and the shift of
    its unlisted scores ``[rows]`` (``_cluster_keys``)."""
    rows, N = scores.shape
    C, S = members.shape[-2:]
    exact, shifts = listing if listing is not None else (scores, scores)
    for low, high, block in size_classes(S, small):
        _select_kernel[(rows * C,)](
            scores,
            members,
            counts,
            quotas,
            offsets,
            out,
            exact,
            shifts,
            N,
            C,
            S,
            members.stride(1),
            out.shape[-1],
            rows_per_head,
            low,
            high,
            exact.shape[-1],
            BLOCK=block,
            BLOCKWISE=low >= block,
            FEW=FEW_PICKS,
            BOXED=listing is not None,
            num_warps=_warps(block),
        )
