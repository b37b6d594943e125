"""ErrorGate — budget allocation by estimated proxy error (OpenAttention paper, §3.3, Eqs. 6–7).

Under a Gaussian model of the logits inside cluster b, the weight discrepancy its proxy leaves is
ε̂_b = n_b e^{z̄_b} e^{σ̂_b²/2} (2Φ(σ̂_b) − 1) (Eq. 6). The selectable budget is water-filled in proportion to it,
q_b = min(n_b, λ ε̂_b / max ε̂) with Σ q_b = E_sel (Eq. 7). Everything is in log space: e^{z̄_b} overflows.

With a GQA group sharing one selection, each head's ε̂ is divided by its Gaussian estimate of the partition function
Ẑ = Σ_b n_b e^{z̄_b + σ̂_b²/2} (so it becomes that head's relative error, Eq. 3) and the heads' shares are summed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import AllocationInput, Allocator


def log_error_estimate(mean_logit: Tensor, logit_var: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """(ln ε̂_b, ln of the cluster's Gaussian mass n_b e^{z̄_b + σ̂_b²/2}), both ``[..., C]``. Empty clusters: -inf."""
    sigma = logit_var.sqrt()
    log_mass = torch.log(counts) + mean_logit + logit_var / 2
    # 2Φ(σ) − 1 = erf(σ/√2); a cluster of identical logits (σ = 0) has no error.
    return log_mass + torch.log(torch.erf(sigma / math.sqrt(2))), log_mass


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


class ErrorGate(Allocator):
    """ErrorGate: water-fill the budget in proportion to each proxy's estimated error (paper Eqs. 6–7)."""

    name = "errorgate"

    def allocate(self, inputs: AllocationInput) -> Tensor:
        counts = inputs.counts[:, :, None, None, :]
        log_error, log_mass = log_error_estimate(inputs.mean_logit, inputs.logit_var, counts)
        relative = log_error - torch.logsumexp(log_mass, dim=-1, keepdim=True)
        return water_fill(inputs.combine_heads(relative), counts, inputs.budget)


@hookimpl
def register_allocators(register):
    register(ErrorGate)
