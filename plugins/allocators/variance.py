"""Variance allocation (the paper's Table 3 ablation): water-fill by each cluster's logit spread σ̂_b, whatever its
weight — the part of ErrorGate's estimate that says how wrong a proxy is, without how much it matters."""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import AllocationInput
from oa_core.ops.water_filling import WaterFillAllocator


class VarianceAllocator(WaterFillAllocator):
    """Variance: water-fill by each cluster's logit spread σ̂_b."""

    name = "variance"

    def log_priority(self, inputs: AllocationInput, counts: Tensor) -> Tensor:
        return 0.5 * torch.log(inputs.logit_var)


@hookimpl
def register_allocators(register):
    register(VarianceAllocator)
