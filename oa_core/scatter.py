"""Index tensors with a spare slot: rows that belong nowhere (id C, padding, -1) go to one extra slot, dropped after
the scatter, so that no mask or Python loop is needed. Shared by the core and the plugins."""

from __future__ import annotations

import torch
from torch import Tensor


def sum_by_slot(ids: Tensor, values: Tensor, slots: int, total: Tensor | None = None) -> Tensor:
    """``values`` ``[..., n, *F]`` summed by ``ids`` ``[..., n]`` (in [0, slots]; ``slots`` means none) →
    ``[..., slots, *F]``, added to ``total`` when given."""
    dim = ids.dim() - 1
    index = ids.reshape(*ids.shape, *([1] * (values.dim() - ids.dim()))).expand_as(values)
    if total is None:
        shape = list(values.shape)
        shape[dim] = slots + 1
        out = values.new_zeros(shape)
    else:
        out = torch.cat([total, torch.zeros_like(total.narrow(dim, 0, 1))], dim)
    return out.scatter_add_(dim, index, values).narrow(dim, 0, slots)


def count_by_slot(ids: Tensor, slots: int, dtype: torch.dtype = torch.long) -> Tensor:
    """How many of ``ids`` ``[..., n]`` fall in each of ``slots`` slots → ``[..., slots]``."""
    return sum_by_slot(ids, torch.ones(ids.shape, dtype=dtype, device=ids.device), slots)


def positions(mask: Tensor, width: int | None = None) -> Tensor:
    """``[..., N]`` bool → the True positions in order ``[..., K]``, padded with -1; K = ``width`` (at least every
    row's count) or, when None, the largest count."""
    if width is None:
        width = int(mask.sum(-1).max()) if mask.numel() else 0
    return compact(torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape), mask, width)


def compact(values: Tensor, keep: Tensor, width: int) -> Tensor:
    """``values`` ``[..., N]`` (integer) where ``keep`` → those kept, in order, ``[..., width]``, padded with -1."""
    width = min(width, values.shape[-1])
    # The k-th kept value goes to slot k (a running count, no sort); the rest to a spare slot, dropped.
    slot = keep.long().cumsum(-1) - 1
    slot = torch.where(keep & (slot < width), slot, width)
    out = torch.full((*values.shape[:-1], width + 1), -1, dtype=values.dtype, device=values.device)
    return out.scatter_(-1, slot, values)[..., :width]
