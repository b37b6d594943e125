"""Mass allocation (the paper's Table 3 ablation): water-fill by each cluster's share of the attention mass,
n_b e^{z̄_b}, instead of ErrorGate's error estimate — reads go where the weight is, not where the proxy is wrong."""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import AllocationInput
from oa_core.ops.water_filling import WaterFillAllocator, log_total


class MassAllocator(WaterFillAllocator):
    """Mass: water-fill by each cluster's attention mass n_b e^{z̄_b} (z̄_b + ln n_b)."""

    name = "mass"

    def log_priority(self, inputs: AllocationInput, counts: Tensor) -> Tensor:
        log_mass = torch.log(counts) + inputs.mean_logit
        return log_mass - log_total(log_mass)


@hookimpl
def register_allocators(register):
    register(MassAllocator)
