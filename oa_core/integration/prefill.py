"""A layer's dense attention — sdpa, or the model's own eager attention where its math is more than a softmax over the
mask —, the valid keys of a padded batch, and the prefill queries QGC takes its geometry from."""

from __future__ import annotations

import sys
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


# The keywords with which a model's attention is more than a softmax over the mask: logit soft-capping (Gemma 2),
# learned sink logits (gpt-oss: ``s_aux``; ``sinks``), an additive position bias. OpenAttention's pipelines model none
# of them and torch's sdpa none either: a layer whose attention receives one keeps the model's own eager attention.
OWN_MATH = {
    "softcap": "logit soft-capping",
    "s_aux": "learned sink logits",
    "sinks": "learned sink logits",
    "position_bias": "a position bias",
}


def own_math(kwargs: Mapping[str, Any], attention_mask: Tensor | None = None) -> str | None:
    """Why a layer whose attention is called with ``kwargs`` and ``attention_mask`` keeps the model's own attention
    (None: its attention is a softmax over the mask, which the pipelines and sdpa compute). A float mask with other
    values than 0 on the keys it lets through carries a bias (Falcon's ALiBi adds its own to the mask)."""
    for name, what in OWN_MATH.items():
        value = kwargs.get(name)
        if value is None or (isinstance(value, int | float) and value == 0):  # softcap 0: none (flash's convention)
            continue
        shown = f"{value:g}" if isinstance(value, int | float) else "a tensor"
        return f"dense: {what} ({name}={shown}), which OpenAttention does not model (the model's own eager attention)"
    if attention_mask is not None and attention_mask.is_floating_point():
        seen = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        if bool(attention_mask.masked_fill(~seen, 0).any()):
            return (
                "dense: a bias in the attention mask (as ALiBi adds), which OpenAttention does not model (the model's "
                "own eager attention)"
            )
    return None


def narrow_values(key: Tensor, value: Tensor) -> str | None:
    """Why a layer whose values are narrower than its keys (DeepSeek's latent attention) keeps the model's own
    attention (None: one head dim), which no pipeline takes."""
    if key.shape[-1] == value.shape[-1]:
        return None
    return (
        f"dense: values of {value.shape[-1]} dims beside keys of {key.shape[-1]}, which the pipelines do not take "
        "(the model's own attention)"
    )


def model_eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """The model's own eager attention, ``eager_attention_forward`` of the module's modeling file (every transformers
    decoder has one; it applies the keywords ``OWN_MATH`` names). Its mask is additive: a boolean mask (sdpa's, which
    the patched model makes) becomes 0 where a key is seen and the dtype's minimum elsewhere."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise TypeError(
            f"{type(module).__name__}: its attention takes {', '.join(k for k in OWN_MATH if k in kwargs)}, which "
            "needs the model's own eager attention, and its modeling module has no eager_attention_forward"
        )
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        low = torch.finfo(query.dtype).min
        attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(~attention_mask, low)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


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
