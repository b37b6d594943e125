"""Index tensors with a spare slot: rows that belong nowhere (id C, padding, -1) go to one extra slot, dropped after
the scatter, so that no mask or Python loop is needed. Shared by the core and the plugins."""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core.ops.triton_path import tl, triton


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


def pooled_sums(
    ids: Tensor,
    keys: Tensor,
    values: Tensor,
    slots: int,
    totals: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    use_triton: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The pooled sums of rows by slot: keys/values ``[B, H, n, D]`` (any float dtype), ids ``[B, H, n]`` in [0,
    ``slots``] (``slots``: none) → (count ``[B, H, slots]``, Σk, Σv, Σk⊙k ``[B, H, slots, D]``), float32, added to
    ``totals`` (the same four) when given.

    ``use_triton`` None: on CUDA tensors, one Triton pass (``_pooled_sums``) — the rows sorted by slot, a program per
    (batch row, head, slot) reads its rows in their own dtype and sums them in registers, in row order (the same sums
    from run to run; 1.5 against 4.6 ms at 16 × 8 heads × 16K rows of 128 bfloat16, 64 slots, on an H200,
    ``benchmarks/studies/results/prepare_h200_model.json``); elsewhere, float32 copies and four scatter-adds. True: the
    Triton pass wherever Triton runs (on the CPU under ``TRITON_INTERPRET=1``)."""
    if use_triton is None:
        use_triton = keys.is_cuda
    if not (use_triton and triton is not None):
        k, v = keys.float(), values.float()
        count, key_sum, value_sum, key_square_sum = totals if totals is not None else (None,) * 4
        return (
            sum_by_slot(ids, torch.ones_like(k[..., 0]), slots, count),
            sum_by_slot(ids, k, slots, key_sum),
            sum_by_slot(ids, v, slots, value_sum),
            sum_by_slot(ids, k * k, slots, key_square_sum),
        )
    B, H, n, D = keys.shape
    counts = count_by_slot(ids, slots)
    starts = counts.cumsum(-1) - counts
    order = ids.argsort(dim=-1, stable=True)
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    key_sum, value_sum, key_square_sum = (
        torch.empty(B, H, slots, D, dtype=torch.float32, device=keys.device) for _ in range(3)
    )
    if key_sum.numel():
        _pooled_sums[(slots, B * H)](
            keys,
            values,
            order.contiguous(),
            starts.contiguous(),
            counts.contiguous(),
            key_sum,
            value_sum,
            key_square_sum,
            n,
            H,
            slots,
            *keys.stride()[:3],
            *values.stride()[:3],
            D=D,
            BLOCK_D=triton.next_power_of_2(D),
            BLOCK_N=32,
        )
    sums = (counts.float(), key_sum, value_sum, key_square_sum)
    if totals is None:
        return sums
    count_total, key_total, value_total, square_total = (total + new for total, new in zip(totals, sums))
    return count_total, key_total, value_total, square_total


def min_by_slot(ids: Tensor, values: Tensor, slots: int) -> Tensor:
    """The least of ``values`` ``[..., n]`` by ``ids`` ``[..., n]`` (in [0, slots]; ``slots`` means none) →
    ``[..., slots]``, +inf for a slot nothing falls in."""
    out = values.new_full((*values.shape[:-1], slots + 1), float("inf"))
    return out.scatter_reduce_(-1, ids, values, "amin").narrow(-1, 0, slots)


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


if triton is not None:

    @triton.jit
    def _pooled_sums(
        K,
        V,
        ORDER,
        STARTS,
        COUNTS,
        KEY_SUM,
        VALUE_SUM,
        KEY_SQUARE_SUM,
        n,
        H,
        slots,
        kb,
        kh,
        kn,
        vb,
        vh,
        vn,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Program (slot c, batch row · head): the sums of its rows, which ORDER lists from STARTS for COUNTS."""
        c = tl.program_id(0).to(tl.int64)
        bh = tl.program_id(1).to(tl.int64)
        b, h = bh // H, bh % H
        start = tl.load(STARTS + bh * slots + c)
        count = tl.load(COUNTS + bh * slots + c)
        offs_d = tl.arange(0, BLOCK_D)
        in_d = offs_d < D
        key_sum = tl.zeros([BLOCK_D], tl.float32)
        value_sum = tl.zeros([BLOCK_D], tl.float32)
        key_square_sum = tl.zeros([BLOCK_D], tl.float32)
        for first in range(0, count, BLOCK_N):
            at = first + tl.arange(0, BLOCK_N)
            inside = at < count
            row = tl.load(ORDER + bh * n + start + at, mask=inside, other=0)
            both = inside[:, None] & in_d[None, :]
            k = tl.load(K + b * kb + h * kh + row[:, None] * kn + offs_d[None, :], mask=both, other=0.0).to(tl.float32)
            v = tl.load(V + b * vb + h * vh + row[:, None] * vn + offs_d[None, :], mask=both, other=0.0).to(tl.float32)
            key_sum += tl.sum(k, axis=0)
            value_sum += tl.sum(v, axis=0)
            key_square_sum += tl.sum(k * k, axis=0)
        out = (bh * slots + c) * D + offs_d
        tl.store(KEY_SUM + out, key_sum, mask=in_d)
        tl.store(VALUE_SUM + out, value_sum, mask=in_d)
        tl.store(KEY_SQUARE_SUM + out, key_square_sum, mask=in_d)


def gather_rows(table: Tensor, index: Tensor) -> Tensor:
    """``table`` ``[B, H, N, D]`` at ``index`` ``[B, H, M]`` (positions in [0, N)) → ``[B, H, M, D]``: whole rows
    copied, as ``table.gather(2, index[..., None].expand(..., D))`` gives them, by one ``index_select`` over the
    flattened rows (on 2 CPU cores 0.024 against 0.15 ms for 3 × 1227 rows of 64)."""
    B, H, N, D = table.shape
    base = torch.arange(B * H, device=index.device).view(B, H, 1) * N
    return table.reshape(B * H * N, D).index_select(0, (index + base).reshape(-1)).view(B, H, -1, D)


def gathers_more_than_it_holds(rows: int, table: Tensor) -> bool:
    """Whether gathering ``rows`` rows per (batch row, head) of ``table`` ``[B, H, N, D]`` would read more than the
    table holds: then one product over the whole table reads fewer bytes than ``gather_rows`` (the rule of the
    re-rank's shortlist and the torch kernel's rows, e.g. a question's causal block of queries)."""
    return rows >= table.shape[2]
