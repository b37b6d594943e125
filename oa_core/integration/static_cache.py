"""The fast decode path in transformers: a static cache whose layers hold, beside K and V, the OpenAttention state of
``oa_core.static``, and a decode step that ``generate()`` compiles and captures in one CUDA graph.

    handle = oa.patch(model, spec)
    cache = handle.static_cache(max_new_tokens=32)
    model.generate(**inputs, max_new_tokens=32, cache=cache)   # past_key_values=cache before transformers 5.24
                                                               # (oa.cache_kwargs(model, cache): either)

The cache's capacity is fixed at the prefill: the prompt plus ``max_new_tokens``. The prefill runs eagerly — the
model's own dense attention, then each layer's ``prepare`` and the state moved into preallocated buffers. Each decode
step writes the new K/V row in place (``StaticLayer``'s way) and calls one custom op per layer, ``oa::static_step``,
which grows the state and attends on the device without waiting for it: ``generate`` sees a compileable cache and
compiles the step (``torch.compile``, CUDA graphs). Layers whose state the fast path cannot hold (a row whose budget
covers its context) attend densely over their valid rows and say so in the stats.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, StaticLayer

from oa_core.integration.prefill import key_mask, recorded_queries
from oa_core.integration.stats import Span
from oa_core.ops.dense_decode import dense_decode
from oa_core.static import StaticState, StaticUnsupported, unsupported

# key → state, for the custom op (which takes tensors and numbers only); the cache layer holds the state itself.
_STATES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@torch.library.custom_op("oa::static_step", mutates_args=("state",))
def static_step(query: Tensor, keys: Tensor, values: Tensor, state: list[Tensor], key: int) -> Tensor:
    """One decode step of the layer whose ``StaticState`` is registered under ``key``, over the buffers ``state``
    (``StaticState.buffers``): the step writes these tensors, which under the compiler may be its copies of the
    state's own."""
    return _STATES[key].with_buffers(state).step(query, keys, values)


@static_step.register_fake
def _(query, keys, values, state, key):
    return torch.empty_like(query)


@torch.library.custom_op("oa::dense_step", mutates_args=())
def dense_step(query: Tensor, keys: Tensor, values: Tensor, length: Tensor, start: Tensor, scale: float) -> Tensor:
    """One decode step of a layer that reads every valid slot (``oa_core.ops.dense_decode``)."""
    return dense_decode(query, keys, values, length, start, scale)


@dense_step.register_fake
def _(query, keys, values, length, start, scale):
    return torch.empty_like(query)


class OALayer(StaticLayer):
    """A static cache layer (K and V ``[B, Hkv, capacity, D]``, written in place) that also holds its layer's
    ``StaticState`` once the prefill has prepared it. The capacity is the prompt plus ``max_new_tokens``."""

    def __init__(self, runtime, max_new_tokens: int) -> None:
        super().__init__(max_cache_len=0)
        self.runtime = runtime
        self.max_new_tokens = max_new_tokens
        self.state: StaticState | None = None
        self.start: Tensor | None = None  # each row's first valid slot (left padding), set at the prefill
        self.prefilled = False
        self.dense_reason = ""  # why this layer decodes densely, if it does

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.max_cache_len = key_states.shape[2] + self.max_new_tokens
        super().lazy_initialization(key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The prompt's own length until the capacity is set (generate builds the prompt's mask before the first
        update), then the capacity. generate asks before every step, eagerly: where the step would not fit, it raises
        (one read of the position from the device)."""
        if not self.is_initialized:
            return query_length, 0
        decoding = query_length == 1  # a prompt starts the cache anew (``update`` checks that it fits)
        if decoding and not torch.compiler.is_compiling() and int(self.cumulative_length) + 1 > self.max_cache_len:
            raise ValueError(
                f"static cache: full at {self.max_cache_len} slots (the prompt and the max_new_tokens "
                f"it was made for, {self.max_new_tokens}); make it with max_new_tokens at least "
                "generate's"
            )
        return self.max_cache_len, 0

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if key_states.shape[2] > 1 and self.is_initialized and not torch.compiler.is_compiling():
            if self.prefilled:
                raise ValueError(
                    f"static cache: {key_states.shape[2]} new tokens after its prompt; it decodes one "
                    "token per step (call cache.reset() before another prompt; continue a conversation "
                    "with the default cache)"
                )
            if key_states.shape[2] + self.max_new_tokens > self.max_cache_len:
                raise ValueError(
                    f"static cache: a prompt of {key_states.shape[2]} tokens and {self.max_new_tokens} "
                    f"new ones do not fit its capacity of {self.max_cache_len} (set by the first prompt); "
                    "make a new cache"
                )
        self.runtime.static = self
        return super().update(key_states, value_states, *args, **kwargs)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reordering of the batch rows: refused once a row moves, where the layer holds a state (its
        clusters, pooled sums and codes are per row, and in place for the compiled step) — never a wrong answer."""
        if self.state is not None and not torch.equal(beam_idx.cpu(), torch.arange(len(beam_idx))):
            raise ValueError(
                "static cache: beam search reorders the batch's rows, which OpenAttention's per-row state on the "
                "static cache does not follow; decode beams on the default cache (generate without cache=)"
            )
        super().reorder_cache(beam_idx)

    def reset(self) -> None:
        super().reset()
        self.state = None
        self.start = None
        self.prefilled = False
        self.dense_reason = ""


class OACache(Cache):
    """The static cache of a patched model (``handle.static_cache``): one ``OALayer`` per attention layer."""

    def __init__(self, runtimes: dict[int, Any], max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        for layer, runtime in sorted(runtimes.items()):
            why = unsupported(runtime.pipeline) if runtime.pipeline is not None else None
            if why:
                raise ValueError(
                    f"static cache: layer {layer}'s spec cannot run on the fast path: {why}; use the default cache"
                )
        super().__init__(layers=[OALayer(runtimes[layer], max_new_tokens) for layer in sorted(runtimes)])


def prefill(
    runtime,
    layer: OALayer,
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    scaling,
    dropout,
    scale: float,
    **kwargs,
) -> tuple[Tensor, None]:
    """The prompt (of any length, one token included): the model's own dense attention over its rows, then the
    layer's state prepared from them (the last prefill queries give QGC its geometry) and moved into static
    buffers."""
    n = query.shape[2]
    layer.prefilled = True
    if attention_mask is not None:  # a reused cache's mask spans its capacity
        attention_mask = attention_mask[..., :n]
    key, value = key[:, :, :n], value[:, :, :n]
    out, weights = runtime.dense(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    mask = key_mask(attention_mask, key)
    layer.start = (~mask).sum(-1)
    torch._dynamo.mark_static_address(layer.start)
    if runtime.pipeline is None:
        layer.dense_reason = runtime.dense_reason
        runtime.log("prefill", 0, n, dense=True, reason=runtime.dense_reason)
        return out, weights
    prepare = Span(key)
    try:
        state = runtime.pipeline.prepare(key, value, recorded_queries(query, mask), scale, mask=mask)
        layer.state = StaticState.from_state(state, layer.max_cache_len, layer.cumulative_length)
        layer.state.key = next(_KEYS)  # a new key per state: a compiled step never reaches a state it was not made for
        _STATES[layer.state.key] = layer.state
        for buffer in layer.state.buffers():
            torch._dynamo.mark_static_address(buffer)
    except StaticUnsupported as why:
        layer.dense_reason = f"dense: {why}"
    runtime.log(
        "prefill", 0, n, dense=True, reason=layer.dense_reason or "dense prefill (static cache)", prepare=prepare.stop()
    )
    if layer.state is not None:  # the steps run inside the compiled step: one record says what each will read
        lengths = mask.sum(-1)
        runtime.log(
            "decode",
            n,
            0,
            dense=False,
            density=float((runtime.pipeline.spec.budget.rows(lengths) / lengths).mean()),
            reason="static cache: each decode step reads this budget (steps are not recorded one by one; "
            + (f"{layer.state.fused.note})" if layer.state.fused is not None else "each component in turn)"),
        )
    return out, weights


def decode(layer: OALayer, query: Tensor, key: Tensor, value: Tensor, scale: float) -> tuple[Tensor, None]:
    """One decode token per row: ``oa::static_step``, or — where the layer reads every row (a layer of
    ``dense_layers``, or a budget that covers the context) — ``oa::dense_step`` over the valid slots. (A layer that
    keeps the model's own attention — a window, math of its own — attends through it: ``LayerRuntime.__call__``.)"""
    if layer.state is None:
        out = torch.ops.oa.dense_step(query, key, value, layer.cumulative_length, layer.start, scale)
    else:
        state = layer.state
        out = torch.ops.oa.static_step(query, key, value, state.buffers(), state.key)
    return out.transpose(1, 2).contiguous(), None
