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
from oa_core.components import AllocationInput
from oa_plugins.allocators.water_filling import WaterFillAllocator, log_total


def log_error_estimate(mean_logit: Tensor, logit_var: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """(ln ε̂_b, ln of the cluster's Gaussian mass n_b e^{z̄_b + σ̂_b²/2}), both ``[..., C]``. Empty clusters: -inf."""
    sigma = logit_var.sqrt()
    log_mass = torch.log(counts) + mean_logit + logit_var / 2
    # 2Φ(σ) − 1 = erf(σ/√2); a cluster of identical logits (σ = 0) has no error.
    return log_mass + torch.log(torch.erf(sigma / math.sqrt(2))), log_mass


class ErrorGate(WaterFillAllocator):
    """ErrorGate: water-fill the budget in proportion to each proxy's estimated error (paper Eqs. 6–7)."""

    name = "errorgate"

    def log_priority(self, inputs: AllocationInput, counts: Tensor) -> Tensor:
        log_error, log_mass = log_error_estimate(inputs.mean_logit, inputs.logit_var, counts)
        return log_error - log_total(log_mass)


@hookimpl
def register_allocators(register):
    register(ErrorGate)
