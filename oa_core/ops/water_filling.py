"""Water-filling (OpenAttention paper, Eq. 7): the selectable budget split in proportion to a per-cluster priority,
capped by cluster sizes. ErrorGate's priority is its error estimate; the ablation allocators swap in another: each
subclasses ``WaterFillAllocator`` and gives ``log_priority``. On CUDA tensors one Triton program per row fills it
(``water_fill_row``, which fused allocation kernels call too); elsewhere the torch ops run."""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core.components import AllocationInput, Allocator
from oa_core.ops import triton_path
from oa_core.ops.triton_path import tl, triton


def water_fill(log_priority: Tensor, capacity: Tensor, budget: Tensor | int) -> Tensor:
    """Integer q_b = min(n_b, λ p_b) with Σ q_b = min(budget, Σ n_b), p_b = e^{log_priority_b − max}.

    log_priority ``[..., C]``, capacity ``[..., C]`` and budget ``[...]`` (broadcastable) → quotas ``[..., C]``
    (long). Clusters of zero priority take budget only once every other cluster is full. Rounding: floor, then the
    largest remainders.
    """
    if triton_applies(log_priority):
        return water_fill_triton(log_priority, capacity, budget)
    log_priority = log_priority.double()
    capacity = capacity.double().expand_as(log_priority)
    top = log_priority.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    # The 1e-200 floor (float64) keeps λ finite when every estimate is zero, and orders zero-priority clusters last.
    p = torch.exp(log_priority - top) + 1e-200 * capacity
    budget = torch.as_tensor(budget, dtype=torch.float64, device=top.device).unsqueeze(-1)
    target = torch.minimum(budget, capacity.sum(-1, keepdim=True))

    # Σ_b min(n_b, λ p_b) is piecewise linear in λ with breakpoints n_b / p_b: find the segment holding the target.
    # With breakpoints sorted, at the j-th the first j clusters are full and the rest grow with slope Σ_{i>j} p_i;
    # suffix sums are accumulated from the small end so that tiny priorities are not lost to cancellation.
    breaks, order = torch.where(capacity > 0, capacity / p, torch.zeros_like(p)).sort(-1)
    edge = torch.zeros_like(top)
    full = torch.cat([edge, capacity.gather(-1, order).cumsum(-1)], dim=-1)  # Σ_{i<j} n_i
    slope = torch.cat([p.gather(-1, order).flip(-1).cumsum(-1).flip(-1), edge], dim=-1)  # Σ_{i≥j} p_i
    segment = (full[..., 1:] + breaks * slope[..., 1:] < target).sum(-1, keepdim=True)
    lam = (target - full.gather(-1, segment)) / slope.gather(-1, segment).clamp_min(1e-300)
    quotas = torch.minimum(capacity, lam * p)

    floor = quotas.floor().clamp_max(capacity)
    remainder = (target - floor.sum(-1, keepdim=True)).round().long()
    fraction = torch.where(floor < capacity, quotas - floor, torch.full_like(floor, -1.0))
    rank = fraction.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return floor.long() + (rank < remainder).long()


# Above this many clusters the [C × C] tiles of the Triton kernels no longer fit in registers: the torch path runs.
MAX_TRITON_CLUSTERS = 256


def triton_applies(tensor: Tensor, on_cpu: bool = False) -> bool:
    """Whether the Triton allocation kernels run on tensors like ``tensor`` ``[..., C]`` (at most MAX_TRITON_CLUSTERS):
    CUDA tensors; CPU tensors too when ``on_cpu`` and Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``,
    as in the tests: tens of ms a row there, so the torch ops stay the CPU path)."""
    if tensor.shape[-1] > MAX_TRITON_CLUSTERS or triton_path.unavailable_reason(tensor.device) is not None:
        return False
    return tensor.is_cuda or on_cpu


def launch_config(num_clusters: int) -> tuple[int, int]:
    """(BLOCK_C, num_warps) of the one-row-per-program kernels over ``num_clusters``. Two warps up to 64 clusters
    (a row is latency-bound, and one warp spills the [C × C] float64 tiles), eight above."""
    block = max(16, triton.next_power_of_2(num_clusters))
    return block, 2 if block <= 64 else 8


def water_fill_triton(log_priority: Tensor, capacity: Tensor, budget: Tensor | int) -> Tensor:
    """``water_fill`` in one Triton kernel (a program per row; the GPU path). Without sorting: the segment of λ
    holding the target comes from f at every breakpoint, f(λ) = Σ_b min(n_b, λ p_b), a [C × C] comparison."""
    shape = log_priority.shape
    C = shape[-1]
    rows = log_priority.double().reshape(-1, C).contiguous()
    cap = capacity.double().expand(shape).reshape(-1, C).contiguous()
    budget = torch.as_tensor(budget, dtype=torch.float64, device=log_priority.device).expand(shape[:-1])
    out = torch.empty(rows.shape, dtype=torch.long, device=log_priority.device)
    if rows.numel():
        block, warps = launch_config(C)
        _water_fill[(rows.shape[0],)](
            rows, cap, budget.reshape(-1).contiguous(), out, C, BLOCK_C=block, num_warps=warps
        )
    return out.view(shape)


if triton is not None:

    @triton.jit
    def water_fill_row(log_priority, cap, budget, offs, ok):
        """One row of ``water_fill`` (shared by the Triton allocation kernels): log priorities ``[BLOCK_C]`` (float64,
        -inf where ``ok`` is False), capacities (float64, 0 there) and the row's budget (float64) → quotas (int64).

        Without sorting: the segment of λ holding the target comes from f at every breakpoint,
        f(λ) = Σ_b min(n_b, λ p_b), a [C × C] comparison; the largest remainders by a [C × C] rank. Both tiles are
        [other cluster j, cluster i] and reduce along axis 0, which Triton's default layout keeps within a thread (the
        other way round costs a warp shuffle per row and twice the instructions)."""
        top = tl.max(log_priority, axis=0)
        top = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
        # The 1e-200 floor (a float64 constant) keeps λ finite when every estimate is zero, and orders zero-priority
        # clusters last.
        p = tl.exp(log_priority - top) + 1e-200 * cap
        target = tl.minimum(budget, tl.sum(cap, axis=0))
        breaks = tl.where(cap > 0, cap / tl.where(cap > 0, p, 1.0), 0.0)  # p > 0 wherever cap > 0
        # f at each breakpoint; those below the target are passed (their clusters full), the rest still grow.
        at_break = tl.sum(tl.minimum(cap[:, None], breaks[None, :] * p[:, None]), axis=0)
        passed = (at_break < target) & ok
        full = tl.sum(tl.where(passed, cap, 0.0), axis=0)
        slope = tl.sum(tl.where(passed | ~ok, 0.0, p), axis=0)
        lam = (target - full) / tl.maximum(slope, 1e-300)
        # A passed cluster is full. (Not min(n_b, λ p_b): where the target falls on a breakpoint that rounding put
        # below it, λ comes out 0 and would empty the full clusters too.)
        quotas = tl.where(passed, cap, tl.minimum(cap, lam * p))
        floor = tl.minimum(tl.floor(quotas), cap)
        remainder = tl.floor(target - tl.sum(tl.where(ok, floor, 0.0), axis=0) + 0.5)  # an integer in float64
        fraction = tl.where((floor < cap) & ok, quotas - floor, -1.0)
        # Rank by fraction, descending, ties by index (a stable sort's order).
        ahead = (fraction[:, None] > fraction[None, :]) | (
            (fraction[:, None] == fraction[None, :]) & (offs[:, None] < offs[None, :])
        )
        rank = tl.sum((ahead & ok[:, None]).to(tl.int32), axis=0)
        return floor.to(tl.int64) + (rank < remainder).to(tl.int64)

    @triton.jit
    def _water_fill(LOG_PRIORITY, CAPACITY, BUDGET, OUT, C, BLOCK_C: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_C)
        ok = offs < C
        lp = tl.load(LOG_PRIORITY + row * C + offs, mask=ok, other=float("-inf"))
        cap = tl.load(CAPACITY + row * C + offs, mask=ok, other=0.0)
        quotas = water_fill_row(lp, cap, tl.load(BUDGET + row), offs, ok)
        tl.store(OUT + row * C + offs, quotas, mask=ok)


def log_total(log_values: Tensor) -> Tensor:
    """ln Σ_b v_b from ln v_b over the last dim (kept), 0 for a row with nothing in it (all -inf), so that dividing
    by it leaves such a row at -inf instead of NaN (a row read densely inside a sparse batch has no clusters)."""
    total = torch.logsumexp(log_values, dim=-1, keepdim=True)
    return total.masked_fill(~torch.isfinite(total), 0.0)


class WaterFillAllocator(Allocator):
    """Base of the allocators that water-fill by a priority; subclasses give ``log_priority``."""

    @property
    def reads_scores(self) -> bool:  # water-filling reads the clusters' priorities, not the scores
        return False

    def log_priority(self, inputs: AllocationInput, counts: Tensor) -> Tensor:
        """Per query head ``[B, Hkv, g, T, C]`` log priorities (counts ``[B, Hkv, 1, 1, C]``); -inf: never read."""
        raise NotImplementedError

    def allocate(self, inputs: AllocationInput) -> Tensor:
        counts = inputs.counts[:, :, None, None, :]
        return water_fill(inputs.combine_heads(self.log_priority(inputs, counts)), counts, inputs.budget)
