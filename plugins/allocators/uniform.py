"""Uniform allocation: the same number of reads for every cluster (capped by its size), a baseline that uses
no statistics at all."""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import AllocationInput
from oa_core.ops.water_filling import WaterFillAllocator


class UniformAllocator(WaterFillAllocator):
    """Uniform: the budget split evenly over the clusters (capped by their sizes)."""

    name = "uniform"

    def log_priority(self, inputs: AllocationInput, counts: Tensor) -> Tensor:
        return torch.zeros_like(inputs.mean_logit)


@hookimpl
def register_allocators(register):
    register(UniformAllocator)
