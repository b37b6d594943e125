"""Global allocation: no per-cluster split — the E_sel best selector scores over the whole clusterable region.

This is how top-k methods (Quest, oracle top-k, HashAttention) allocate. Expressed as per-cluster quotas (how many
of the global top E_sel fall in each cluster), it runs through the same per-cluster selection as every allocator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import AllocationInput, Allocator
from oa_core.scatter import count_by_slot


class GlobalTopK(Allocator):
    """One budget over the whole clusterable region, taken by selector score (top-k methods)."""

    name = "global"

    def allocate(self, inputs: AllocationInput) -> Tensor:
        return top_counts(inputs.scores, inputs.assignment, inputs.budget, inputs.counts.shape[-1], inputs.width)


def top_counts(scores: Tensor, assignment: Tensor, budget: Tensor, num_clusters: int,
               width: int | None = None) -> Tensor:
    """How many of each row's ``budget`` ``[B, Hkv, 1, 1]`` best ``scores`` ``[B, Hkv, Gs, T, N]`` (-inf: none) fall
    in each cluster of ``assignment`` ``[B, Hkv, N]`` → ``[B, Hkv, Gs, T, C]``. ``width``: a bound of the budget known
    on the host (None: read from it, a device sync)."""
    width = min(width if width is not None else int(budget.max()), scores.shape[-1])
    # A stable sort, not topk: tied scores (a Quest page) go to the earliest positions, on every device.
    top_scores, top = (t[..., :width] for t in scores.sort(dim=-1, descending=True, stable=True))
    assignment = assignment[:, :, None, None, :].expand_as(scores)
    beyond = torch.arange(width, device=scores.device) >= budget[..., None]  # a row's own budget
    clusters = assignment.gather(-1, top).masked_fill((top_scores == float("-inf")) | beyond, num_clusters)
    return count_by_slot(clusters, num_clusters)


@hookimpl
def register_allocators(register):
    register(GlobalTopK)
