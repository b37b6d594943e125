"""Dense decode attention over a static cache: one query per row attends every valid slot [start_b, length) of
buffers ``[B, Hkv, capacity, D]``, with no mask tensor (the rows come from ``start`` and the ``length`` tensor).

On CUDA (and under ``TRITON_INTERPRET=1``) it is flash decoding in Triton: a program per (batch row, KV head, split of
the slots) reads each key and value row once for all the query heads of its group, keeps a running max and sum, and
a second kernel merges the splits. Elsewhere ``dense_decode_reference`` runs: a masked softmax in torch. The fast
decode path uses it for layers that read every row, and as the dense baseline on the same cache.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oa_core.ops import triton_path
from oa_core.ops.triton_path import tl, triton

SPLIT = 512  # slots per program of the first pass
BLOCK_N = 64  # slots per iteration inside a program


def dense_decode(query: Tensor, keys: Tensor, values: Tensor, length: Tensor, start: Tensor, scale: float) -> Tensor:
    """query ``[B, Hq, 1, D]``, keys/values ``[B, Hkv, capacity, D]``, ``length`` 0-d (slots written), ``start``
    ``[B]`` (each row's first valid slot) → ``[B, Hq, 1, D]`` in the query's dtype. Waits for nothing."""
    if triton_path.unavailable_reason(query.device) is not None:
        return dense_decode_reference(query, keys, values, length, start, scale)
    B, Hq, T, D = query.shape
    Hkv, capacity = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    splits = triton.cdiv(capacity, SPLIT)
    q = query.reshape(B, Hkv, G, D).contiguous()
    k, v = keys.contiguous(), values.contiguous()
    m = torch.empty(B, Hkv, splits, G, device=query.device, dtype=torch.float32)
    den = torch.empty_like(m)
    acc = torch.empty(B, Hkv, splits, G, D, device=query.device, dtype=torch.float32)
    block_g = max(16, triton.next_power_of_2(G))
    _split_pass[(B * Hkv, splits)](
        q,
        k,
        v,
        length,
        start,
        m,
        den,
        acc,
        Hkv,
        capacity,
        splits,
        scale,
        G=G,
        BLOCK_G=block_g,
        D=D,
        BLOCK_D=triton.next_power_of_2(D),
        SPLIT=SPLIT,
        BLOCK_N=BLOCK_N,
        HALF=triton_path.tensor_core_dots(query.dtype),
    )
    out = torch.empty(B, Hkv, G, D, device=query.device, dtype=query.dtype)
    _merge[(B * Hkv * G,)](
        m, den, acc, out, splits, G, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_S=triton.next_power_of_2(splits)
    )
    return out.view(B, Hq, T, D)


def dense_decode_reference(
    query: Tensor, keys: Tensor, values: Tensor, length: Tensor, start: Tensor, scale: float
) -> Tensor:
    """``dense_decode`` in torch, float32: softmax over the valid slots of each row."""
    B, Hq, T, D = query.shape
    Hkv, capacity = keys.shape[1], keys.shape[2]
    q = query.float().reshape(B, Hkv, Hq // Hkv, D)
    logits = scale * q @ keys.float().transpose(-1, -2)  # [B, Hkv, G, capacity]
    slot = torch.arange(capacity, device=query.device)
    valid = (slot >= start[:, None]) & (slot < length)  # [B, capacity]
    weights = torch.softmax(logits.masked_fill(~valid[:, None, None, :], -math.inf), -1)
    return (weights @ values.float()).reshape(B, Hq, T, D).to(query.dtype)


if triton is not None:

    @triton.jit
    def _split_pass(
        Q,
        K,
        V,
        LENGTH,
        START,
        M,
        DEN,
        ACC,
        Hkv,
        CAP,
        SPLITS,
        scale,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HALF: tl.constexpr,
    ):
        """Program (batch row · KV head, split): the split's valid slots, all G query heads of the group at once."""
        head = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        b = head // Hkv
        length = tl.load(LENGTH)
        first = tl.maximum(tl.load(START + b), split * SPLIT)
        last = tl.minimum(length, split * SPLIT + SPLIT)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        d_ok = offs_d < D
        q = tl.load(
            Q + (head * G + offs_g[:, None]) * D + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
        )
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(first, last, BLOCK_N):  # nothing where the split holds no valid slot
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < last
            rows = (head * CAP + offs_n[:, None]) * D + offs_d[None, :]
            k = tl.load(K + rows, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if HALF:
                z = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * scale
            else:
                z = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            z = tl.where(n_ok[None, :], z, float("-inf"))
            top = tl.maximum(m, tl.max(z, axis=1))
            safe = tl.where(top == float("-inf"), 0.0, top)
            p = tl.exp(z - safe[:, None])
            correction = tl.exp(m - safe)
            v = tl.load(V + rows, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if HALF:
                acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
            else:
                acc = acc * correction[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            den = den * correction + tl.sum(p, axis=1)
            m = top
        part = (head * SPLITS + split) * G + offs_g
        tl.store(M + part, m, mask=g_ok)
        tl.store(DEN + part, den, mask=g_ok)
        tl.store(ACC + part[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge(M, DEN, ACC, OUT, SPLITS, G, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        """Program (batch row · KV head · query head): the splits rescaled to one max, summed, divided."""
        row = tl.program_id(0).to(tl.int64)
        head, g = row // G, row % G
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < SPLITS
        part = (head * SPLITS + offs_s) * G + g
        m = tl.load(M + part, mask=s_ok, other=float("-inf"))
        top = tl.max(m, axis=0)
        weight = tl.where(s_ok & (m > float("-inf")), tl.exp(m - top), 0.0)
        den = tl.sum(weight * tl.load(DEN + part, mask=s_ok, other=0.0), axis=0)
        acc = tl.load(ACC + part[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0) / den
        tl.store(OUT + row * D + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < D)
