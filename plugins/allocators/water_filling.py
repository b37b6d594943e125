"""Water-filling (OpenAttention paper, Eq. 7): the selectable budget split in proportion to a per-cluster priority,
capped by cluster sizes. ErrorGate's priority is its error estimate; the ablation allocators swap in another."""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core.components import AllocationInput, Allocator


def water_fill(log_priority: Tensor, capacity: Tensor, budget: Tensor | int) -> Tensor:
    """Integer q_b = min(n_b, λ p_b) with Σ q_b = min(budget, Σ n_b), p_b = e^{log_priority_b − max}.

    log_priority ``[..., C]``, capacity ``[..., C]`` and budget ``[...]`` (broadcastable) → quotas ``[..., C]`` (long). Clusters of zero
    priority take budget only once every other cluster is full. Rounding: floor, then the largest remainders.
    """
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


class WaterFillAllocator(Allocator):
    """Base of the allocators that water-fill by a priority; subclasses give ``log_priority``."""

    def log_priority(self, inputs: AllocationInput, counts: Tensor) -> Tensor:
        """Per query head ``[B, Hkv, g, T, C]`` log priorities (counts ``[B, Hkv, 1, 1, C]``); -inf: never read."""
        raise NotImplementedError

    def allocate(self, inputs: AllocationInput) -> Tensor:
        counts = inputs.counts[:, :, None, None, :]
        return water_fill(inputs.combine_heads(self.log_priority(inputs, counts)), counts, inputs.budget)
