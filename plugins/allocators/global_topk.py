"""Global allocation: no per-cluster split — the E_sel best selector scores over the whole clusterable region.

This is how top-k methods (Quest, oracle top-k, HashAttention) allocate. Expressed as per-cluster quotas (how many
of the global top E_sel fall in each cluster), it runs through the same per-cluster selection as every allocator.
"""

from __future__ import annotations

from torch import Tensor

from oa_core import hookimpl
from oa_core.components import AllocationInput, Allocator
from oa_core.ops.selection import top_counts


class GlobalTopK(Allocator):
    """One budget over the whole clusterable region, taken by selector score (top-k methods)."""

    name = "global"

    def allocate(self, inputs: AllocationInput) -> Tensor:
        return top_counts(inputs.scores, inputs.assignment, inputs.budget, inputs.counts.shape[-1], inputs.width)


@hookimpl
def register_allocators(register):
    register(GlobalTopK)
