"""A prompt's dense pass: the model's own attention (sdpa), the valid keys of a padded batch, and the prefill
queries QGC takes its geometry from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from oa_core.ops.geometry import QUERY_WINDOW


def recorded_queries(query: Tensor, mask: Tensor) -> Tensor:
    """The last QUERY_WINDOW prefill queries, padding zeroed: QGC's query geometry. The window is cut before the
    product: a slice of the product would keep all N queries alive (per layer, for as long as the context is kept)."""
    window = slice(-QUERY_WINDOW, None)
    return query[:, :, window] * mask[:, None, window, None]


def key_mask(attention_mask: Tensor | None, key: Tensor) -> Tensor:
    """``[B, N]`` valid keys from a 4D prefill mask (the last query row sees every valid key); all True if None."""
    if attention_mask is None:
        return torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
    row = attention_mask[:, 0, -1, -key.shape[2] :]
    # A copy, never a view: the recorded context would keep the whole [B, 1, N, N] mask alive.
    return row.clone() if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2


def model_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """transformers' ``sdpa`` — the model's own dense attention — except that an unpadded float32 prefill of grouped
    heads on CUDA gets its causal mask spelled out. Without a mask transformers hands torch the key/value groups as
    they are (``enable_gqa``), which no fused CUDA kernel takes in float32: torch's math kernel then materialises the
    [B, Hq, N, N] scores (``benchmarks/studies/prefill_memory.py`` measures it). With a mask it repeats the heads and
    the memory-efficient kernel runs. Not on the CPU, where the grouped call is the faster one."""
    from transformers import AttentionInterface

    if attention_mask is None and _grouped_float32_cuda_prefill(module, query, key, kwargs):
        attention_mask = causal_mask(query.shape[2], query.device)
    return AttentionInterface()["sdpa"](
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def _grouped_float32_cuda_prefill(module, query: Tensor, key: Tensor, kwargs: Mapping[str, Any]) -> bool:
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    return (
        bool(causal)
        and query.is_cuda
        and query.dtype == torch.float32
        and key.shape[1] < query.shape[1]
        and query.shape[2] == key.shape[2] > 1
    )


def causal_mask(length: int, device: torch.device | str) -> Tensor:
    """``[1, 1, N, N]`` boolean: query i sees keys 0..i (sdpa's ``is_causal`` for a prefill with no past)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
