"""The cluster statistics every allocator sees (docs/design.md, step 4), per query head and cluster:
z̄_b = s·q·k̄_b and σ̂_b² = s²·Σ_d q_d² Var_b(k_d), from the clusters' mean key and diagonal key variance.
``tail_logit_variance`` takes the rows read out of σ̂_b² and bounds it by the gap to the least logit read, for the
second-order proxy (step 7).

On CUDA both come from one Triton kernel that reads the query in its own dtype; in torch they take a dtype
conversion, a square, two batched matrix products and two scalings — six launches, each a few microseconds at
decode shapes, where the whole sparse stage is a few hundred.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core.ops import triton_path
from oa_core.ops.scatter import min_by_slot, sum_by_slot
from oa_core.ops.triton_path import tl, triton


def cluster_logit_stats(
    query: Tensor, key_mean: Tensor, key_var: Tensor, scale: float, use_triton: bool | None = None
) -> tuple[Tensor, Tensor]:
    """query ``[B, Hq, T, D]``, key_mean / key_var ``[B, Hkv, C, D]`` → (z̄, σ̂²), each ``[B, Hkv, g, T, C]``, in the
    moments' dtype (float32 from the pipeline). ``use_triton``: None runs the kernel on CUDA tensors and torch
    elsewhere; True runs it wherever Triton can (on the CPU: under ``TRITON_INTERPRET=1``)."""
    B, Hq, T, D = query.shape
    Hkv, C = key_mean.shape[1:3]
    g = Hq // Hkv
    if use_triton is None:
        use_triton = query.is_cuda
    if use_triton and triton_path.unavailable_reason(query.device) is None and key_mean.dtype == torch.float32:
        return _stats_triton(query, key_mean, key_var, scale)
    q = query.to(key_mean.dtype).reshape(B, Hkv, g, T, D)
    return (
        scale * torch.einsum("bhgtd,bhcd->bhgtc", q, key_mean),
        scale**2 * torch.einsum("bhgtd,bhcd->bhgtc", q * q, key_var),
    )


def cluster_logit_stats_from_sums(
    query: Tensor, count: Tensor, key_sum: Tensor, key_square_sum: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """``cluster_logit_stats`` from the pooled sums themselves (count ``[B, Hkv, C]``, Σk and Σk⊙k
    ``[B, Hkv, C, D]``, float32): k̄_b = Σk/n_b and Var_b(k) = Σk⊙k/n_b − k̄_b² (0 at least; n_b ≥ 1), computed
    inside the kernel on CUDA — the fast decode path's step, where the sums change every token."""
    if triton_path.unavailable_reason(query.device) is None:
        return _stats_triton(query, key_sum, key_square_sum, scale, count)
    return cluster_logit_stats(query, *moments_from_sums(count, key_sum, key_square_sum), scale, use_triton=False)


def moments_from_sums(count: Tensor, key_sum: Tensor, key_square_sum: Tensor) -> tuple[Tensor, Tensor]:
    """The pooled sums → (k̄_b = Σk/n_b, Var_b(k) = Σk⊙k/n_b − k̄_b², 0 at least), ``[B, Hkv, C, D]`` each (an
    empty cluster counts as one: zeros)."""
    n = count.clamp_min(1).unsqueeze(-1)
    mean = key_sum / n
    return mean, (key_square_sum / n - mean * mean).clamp_min(0)


def tail_logit_variance(
    query: Tensor,
    read_logits: Tensor,
    read_cluster: Tensor,
    count: Tensor,
    key_sum: Tensor,
    key_square_sum: Tensor,
    tail_count: Tensor,
    scale: float,
) -> Tensor:
    """The second-order proxy's σ̂_T² (docs/design.md, step 7), 0 at least, ``[B, Hkv, g, T, C]``: each cluster's
    diagonal logit variance σ̂_b² with the rows read taken out exactly, (n_b·σ̂_b² − D2 − D1²/n_T)/n_T, where
    D1 = Σ_{X∩b} (z_i − z̄_b) and D2 = Σ_{X∩b} (z_i − z̄_b)²; at most (M_b − z̄_T)², M_b the least logit read from b
    and z̄_T = z̄_b − D1/n_T the tail's mean logit (no bound where nothing of b was read).

    query ``[B, Hkv, g, T, D]``; read_logits z_i = s·q·k_i of the rows read ``[B, Hkv, g, T, K]`` and their clusters
    ``read_cluster`` (C for padding and rows outside every cluster: not counted); count ``[B, Hkv, C]`` and the pooled
    Σk, Σk⊙k ``[B, Hkv, C, D]``; tail_count n_T, broadcastable to the result. One dtype throughout."""
    C = count.shape[-1]
    mean, variance = moments_from_sums(count, key_sum, key_square_sum)
    mean_logit = scale * torch.einsum("bhgtd,bhcd->bhgtc", query, mean)
    logit_var = scale * scale * torch.einsum("bhgtd,bhcd->bhgtc", query * query, variance)
    centre = torch.cat([mean_logit, torch.zeros_like(mean_logit[..., :1])], -1).gather(-1, read_cluster)
    deviation = (read_logits - centre).masked_fill(read_cluster == C, 0.0)
    d1, d2 = sum_by_slot(read_cluster, deviation, C), sum_by_slot(read_cluster, deviation * deviation, C)
    n = tail_count.clamp_min(1)
    spread = ((count[:, :, None, None] * logit_var - d2 - d1 * d1 / n) / n).clamp_min(0)
    gap = (min_by_slot(read_cluster, read_logits, C) - (mean_logit - d1 / n)).clamp_min(0)  # M_b − z̄_T
    return torch.minimum(spread, gap * gap)


BLOCK_C = 16  # clusters per program


def _stats_triton(
    query: Tensor, key_mean: Tensor, key_var: Tensor, scale: float, count: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """With ``count``, ``key_mean`` and ``key_var`` are the pooled Σk and Σk⊙k, turned into moments in the kernel."""
    B, Hq, T, D = query.shape
    Hkv, C = key_mean.shape[1:3]
    g = Hq // Hkv
    mean_logit = torch.empty(B, Hkv, g, T, C, device=query.device, dtype=torch.float32)
    logit_var = torch.empty_like(mean_logit)
    if mean_logit.numel():
        grid = (B * Hkv, triton.cdiv(C, BLOCK_C))
        counts = count.contiguous() if count is not None else mean_logit  # never read without FROM_SUMS
        _cluster_stats[grid](
            query.contiguous(),
            key_mean.contiguous(),
            key_var.contiguous(),
            counts,
            mean_logit,
            logit_var,
            C,
            D,
            g * T,
            scale,
            FROM_SUMS=count is not None,
            BLOCK_C=BLOCK_C,
            BLOCK_D=triton.next_power_of_2(D),
            num_warps=4,
        )
    return mean_logit, logit_var


if triton is not None:

    @triton.jit
    def _cluster_stats(
        Q,
        MEAN,
        VAR,
        COUNT,
        MEAN_LOGIT,
        LOGIT_VAR,
        C,
        D,
        ROWS,
        scale,
        FROM_SUMS: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program per (batch row, KV head, block of BLOCK_C clusters): the block's moments stay in registers
        while each of the head's ROWS = g·T query rows (a KV head's query heads are adjacent) takes two dot products
        per cluster."""
        head = tl.program_id(0).to(tl.int64)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        offs_d = tl.arange(0, BLOCK_D)
        in_c = offs_c < C
        tile = (head * C + offs_c[:, None]) * D + offs_d[None, :]
        ok = in_c[:, None] & (offs_d[None, :] < D)
        mean = tl.load(MEAN + tile, mask=ok, other=0.0)
        var = tl.load(VAR + tile, mask=ok, other=0.0)
        if FROM_SUMS:  # Σk, Σk⊙k → k̄, Var(k), as the state's cluster_moments computes them
            mean, var = moments_tile(mean, var, tl.load(COUNT + head * C + offs_c, mask=in_c, other=1.0))
        for row in range(0, ROWS):
            q = tl.load(Q + (head * ROWS + row) * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
            store_logit_stats(mean, var, q, scale, MEAN_LOGIT, LOGIT_VAR, (head * ROWS + row) * C + offs_c, in_c)

    @triton.jit
    def moments_tile(key_sum, key_square_sum, count):
        """A tile of clusters' Σk and Σk⊙k ``[BLOCK_C, BLOCK_D]`` and counts ``[BLOCK_C]`` → (k̄_b, Var_b(k)), as
        ``moments_from_sums`` has them (an empty cluster counts as one); shared with the fused step's ``grow``."""
        n = tl.maximum(count, 1.0)[:, None]
        mean = tl.div_rn(key_sum, n)
        return mean, tl.maximum(tl.div_rn(key_square_sum, n) - mean * mean, 0.0)

    @triton.jit
    def store_logit_stats(mean, var, q, scale, MEAN_LOGIT, LOGIT_VAR, out, ok):
        """One query row ``q`` (float32 ``[BLOCK_D]``) against a tile's moments → z̄_b = s·q·k̄_b and σ̂_b² =
        s²·Σ_d q_d² Var_b(k_d), stored at ``out`` (lanes ``ok``)."""
        tl.store(MEAN_LOGIT + out, scale * tl.sum(mean * q[None, :], axis=1), mask=ok)
        tl.store(LOGIT_VAR + out, (scale * scale) * tl.sum(var * (q * q)[None, :], axis=1), mask=ok)
