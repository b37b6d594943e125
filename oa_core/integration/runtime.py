"""The attention function transformers calls, and ``patch``/``unpatch``.

An attention function registered under ``"openattention"`` replaces the model's implementation (set with the public
``set_attn_implementation``; nothing else in the model changes). Per attention layer a ``LayerRuntime`` keeps the
pipeline state beside the cache. transformers hands the attention function the whole cache of a layer, not the cache
object, so the runtime recognises its request from the keys themselves:

- a call with no past (prefill of a context) runs sdpa (``LayerRuntime.dense``) and records the context: keys, values,
  the padding mask and the last prefill queries (QGC's query geometry); the pipeline state is prepared from it at
  the first sparse call, once per spec;
- a call on top of a cache it knows (the live state, or a recorded context, checked by length and by a few key
  rows) continues it: new rows are appended and attended sparsely — a question in causal blocks of at most
  ``local`` tokens (``question="sparse"``, the paper's setup B), or densely (``question="dense"``, setup A: only the
  tokens after the first decoded one are sparse);
- a call on a cache it has not seen prepares from that cache (no prefill queries: QGC falls back to the keys).

Layers in ``dense_layers`` always run dense; ``layer_specs`` gives a layer its own spec. A layer keeps the model's own
attention whatever the spec where it attends a sliding window or another local type (``window_reason``), or where its
attention is called with math the pipelines do not model (``prefill.own_math``: soft-capping, sink logits; then
through the model's own eager attention) or with values narrower than its keys (latent attention), on either cache.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from oa_core.integration.prefill import (
    key_mask,
    model_eager,
    model_sdpa,
    narrow_values,
    own_math,
    recorded_queries,
)
from oa_core.integration.stats import GenerationStats, Span, StepRecord
from oa_core.pipeline import Pipeline, build
from oa_core.spec import PipelineSpec, SpecError
from oa_core.state import CacheMismatch, PipelineState, probe_rows

IMPLEMENTATION = "openattention"
Question = Literal["sparse", "dense"]
# The paper's names for the two ways of attending the question
SETUPS: dict[str, Question] = {"A": "dense", "B": "sparse"}

# Attention module → its runtime. Weak keys: a model that goes away takes its runtimes with it.
_RUNTIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Model → the handle that patched it.
_HANDLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class ContextRecord:
    """A densely prefilled context as one layer saw it: the material a pipeline state is prepared from."""

    keys: Tensor
    values: Tensor
    queries: Tensor  # the last prefill queries, padding zeroed
    mask: Tensor  # [B, N] valid positions
    scale: float
    prepared: dict[int, PipelineState] = field(default_factory=dict)  # id(pipeline) → state


FOREIGN_STATIC = (
    "dense: a cache of fixed capacity whose empty slots reach the attention (transformers' static cache, "
    "cache_implementation='static'); OpenAttention's own is handle.static_cache(max_new_tokens=...)"
)


class LayerRuntime:
    """One attention layer's OpenAttention: the pipeline, the recorded context and the live (growing) state."""

    def __init__(self, layer: int, pipeline: Pipeline | None, question: Question = "sparse") -> None:
        self.layer = layer
        self.pipeline = pipeline  # None: this layer stays dense
        self.dense_reason = "dense layer"  # why, where it does (the stats say it)
        # Why the layer keeps the model's own attention whatever the spec (a window, another local type, math the
        # pipelines do not model: ``own_math``), None where a spec may make it sparse; eager: that math needs the
        # model's eager attention (sdpa elsewhere).
        self.keeps_own: str | None = None
        self.eager = False
        self.question = question
        self.context: ContextRecord | None = None
        self.live: PipelineState | None = None
        self.static = None  # the static cache layer of this call, set by its update (the fast decode path)
        self.records: list[StepRecord] = []
        self.foreign_static = False  # this request's cache is a fixed-capacity one not ours (``ends_empty``)

    def keep_own(self, why: str, eager: bool = False) -> None:
        """From now on the layer attends with the model's own attention (``why`` says so in the stats)."""
        self.keeps_own = self.dense_reason = why
        self.eager = eager
        self.pipeline = self.live = None

    def dense(self, module, query, key, value, attention_mask, scaling, dropout, **kwargs):
        """The layer's dense attention: the model's own eager attention where its math is its own, else sdpa."""
        attend = model_eager if self.eager else model_sdpa
        return attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if not self.eager:  # the first call (a prefill) tells, before any state
            why, eager = own_math(kwargs, attention_mask), True
            if why is None and self.keeps_own is None:
                why, eager = narrow_values(key, value), False
            if why is not None:
                self.keep_own(why, eager)
                warnings.warn(f"openattention: a layer keeps the model's own attention — {why}", RuntimeWarning, 2)
        static, self.static = self.static, None
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        if static is not None:  # a static cache (the fast decode path): the prompt, then one token per step
            from oa_core.integration import static_cache  # here: it loads transformers' cache machinery

            if static.prefilled and self.keeps_own:  # over the cache's slots, in the model's mask (window, padding)
                return self.dense(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            if static.prefilled:
                return static_cache.decode(static, query, key, value, scale)
            return static_cache.prefill(
                self, static, module, query, key, value, attention_mask, scaling, dropout, scale, **kwargs
            )
        T, N = query.shape[2], key.shape[2]
        past = N - T
        # Transformers' static cache: checked at every prompt or question, kept through its decode steps (the last
        # of which fills the cache). Its empty slots are no keys.
        sticky = self.foreign_static and T == 1
        self.foreign_static = self.pipeline is not None and past > 0 and (sticky or ends_empty(key, attention_mask))
        if self.pipeline is None or past == 0:
            out, weights = self.dense(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            if self.pipeline is not None:
                self._record_context(query, key, value, attention_mask, scale)
            phase = "prefill" if past == 0 else "question" if T > 1 else "decode"
            self.log(phase, past, T, dense=True, reason="dense prefill" if self.pipeline else self.dense_reason)
            return out, weights
        if self.foreign_static:
            out, weights = self.dense(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            self.log("question" if T > 1 else "decode", past, T, dense=True, reason=FOREIGN_STATIC)
            return out, weights

        while True:
            prepare = Span(key)
            state = self._state_for(key, value, past, scale, attention_mask)
            prepare.stop()
            try:
                return self._attend(
                    state, prepare, module, query, key, value, attention_mask, scaling, dropout, **kwargs
                )
            except CacheMismatch:  # raised by the first growth, before anything changed
                if state is not self.live:
                    raise
                self.live = None  # a cache of the live state's length, other rows: not its continuation

    def _attend(
        self, state: PipelineState, prepare: Span, module, query, key, value, attention_mask, scaling, dropout, **kwargs
    ):
        T, past = query.shape[2], key.shape[2] - query.shape[2]
        phase = "question" if T > 1 else "decode"
        attend = Span(key)
        dense_question = phase == "question" and self.question == "dense"
        if state.plan().all_dense or dense_question:
            state.grow_to(key, value)
            out, weights = self.dense(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            self.live = state
            reason = "dense: question attended densely (setup A)" if dense_question else f"dense: {state.dense_reason}"
            self.log(phase, past, T, dense=True, reason=reason, prepare=prepare, attend=attend.stop())
            return out, weights
        pipe = self.pipeline
        assert pipe is not None  # a dense layer attends in __call__
        outputs, stats = [], []
        block = max(pipe.spec.local, 1)
        for first in range(0, T, block):  # a question attends in causal blocks that fit the local window
            last = min(first + block, T)
            state.grow_to(key[:, :, : past + last], value[:, :, : past + last])  # the cache's rows, not a copy
            out, step = pipe.attend(query[:, :, first:last], state, return_stats=True, causal=True)
            outputs.append(out)
            stats.append(step)
        self.live = state
        proxies = [s.proxies.float().mean() for s in stats if s.proxies is not None]
        self.log(
            phase,
            past,
            T,
            dense=False,
            reason=stats[-1].reason,
            prepare=prepare,
            attend=attend.stop(),
            density=sum(s.density_tensor for s in stats),
            proxies=sum(proxies) if proxies else 0.0,
            blocks=len(stats),
        )
        return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None

    def _record_context(self, query: Tensor, key: Tensor, value: Tensor, attention_mask, scale: float) -> None:
        mask = key_mask(attention_mask, key)
        self.context = ContextRecord(key, value, recorded_queries(query, mask), mask, scale)
        self.live = None

    def _state_for(self, key: Tensor, value: Tensor, past: int, scale: float, attention_mask) -> PipelineState:
        """The state this call continues: the live one, a fork of the recorded context's, or a new one. The live
        state is taken by its length alone (no wait on the device at every step): its growth then checks the rows
        and raises CacheMismatch if they are another cache's."""
        pipe = self.pipeline
        assert pipe is not None  # a dense layer attends in __call__
        if self.live is not None and self.live.pipeline is self.pipeline and _same_length(self.live.keys, key, past):
            return self.live
        context = self.context
        if context is not None and _same_prefix(context.keys, key, past):
            state = context.prepared.get(id(self.pipeline))
            if state is None or state.pipeline is not self.pipeline:
                state = pipe.prepare(context.keys, context.values, context.queries, context.scale, mask=context.mask)
                context.prepared[id(self.pipeline)] = state
            return state.fork()
        # A cache this runtime never saw prefilled (e.g. built before patching): no prefill queries to use; the
        # padding comes from this call's mask.
        return pipe.prepare(
            key[:, :, :past], value[:, :, :past], None, scale, mask=key_mask(attention_mask, key)[:, :past]
        )

    def log(
        self,
        phase: str,
        past: int,
        tokens: int,
        dense: bool,
        reason: str,
        prepare: Span | float = 0.0,
        attend: Span | float = 0.0,
        density: Tensor | float = 1.0,
        proxies: Tensor | float = 0.0,
        blocks: int = 1,
    ) -> None:
        self.records.append(
            StepRecord(self.layer, phase, past, tokens, density, proxies, blocks, dense, reason, prepare, attend)
        )


def _same_length(known: Tensor, key: Tensor, past: int) -> bool:
    """Whether ``key``'s first ``past`` rows can be the ``known`` cache: same batch, heads, length and device."""
    return known.shape[2] == past and known.shape[:2] == key.shape[:2] and known.device == key.device


def _same_prefix(known: Tensor, key: Tensor, past: int) -> bool:
    """Whether ``key``'s first ``past`` rows are the ``known`` cache: same length, same rows at a few positions."""
    if not _same_length(known, key, past):
        return False
    probe = probe_rows(past)
    return torch.equal(known[:, :, probe], key[:, :, probe])


def ends_empty(key: Tensor, attention_mask: Tensor | None) -> bool:
    """Whether the cache ``key`` ``[B, Hkv, N, D]`` ends in a slot no row has written: a cache of fixed capacity (not
    ours, whose layers say so) — its last slot hidden from every row by the mask, or, without a mask (an unpadded
    prompt), all zeros in every row and head, as a preallocated slot is and no real key is."""
    if attention_mask is not None:
        return not bool(key_mask(attention_mask, key)[:, -1].any())
    return not bool(key[:, :, -1].any())


def window_reason(module) -> str | None:
    """Why an attention layer keeps the model's own attention, where its type is not full attention: a sliding
    window (``config.layer_types``, as Gemma 2/3 and Qwen2 give it, or a ``sliding_window`` of every layer, as Mistral
    gives it) or another local type; None for a full-attention layer."""
    config = module.config
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None:
        kind = layer_types[module.layer_idx]
        if kind == "full_attention":
            return None
        if kind == "sliding_attention" and window:
            return f"dense: sliding window of {window} (the model's own attention)"
        return f"dense: {kind} (the model's own attention)"
    window = getattr(module, "sliding_window", window)
    return f"dense: sliding window of {window} (the model's own attention)" if window else None


def is_causal_self_attention(module) -> bool:
    """Whether ``module`` is a decoder's attention layer as transformers writes them (Llama's, GPT-2's, GPT-NeoX's, …):
    a ``layer_idx``, a ``scaling`` and ``is_causal`` set, not attending another sequence."""
    return (
        hasattr(module, "layer_idx")
        and hasattr(module, "scaling")
        and getattr(module, "is_causal", False) is True
        and not getattr(module, "is_cross_attention", False)
    )


def openattention_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered with ``AttentionInterface``: query ``[B, Hq, T, D]``, key/value ``[B, Hkv, N, D]``
    (the layer's whole cache) → (output ``[B, T, Hq, D]``, None)."""
    runtime = _RUNTIMES.get(module)
    if runtime is None and not is_causal_self_attention(module):  # an encoder's (a vision tower's): sdpa
        return model_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if runtime is None:  # the attn_implementation= route: the spec from config.openattention, or the defaults
        spec = getattr(module.config, "openattention", None)
        why = window_reason(module)
        runtime = _RUNTIMES[module] = LayerRuntime(module.layer_idx, build(spec), question="sparse")
        if why:
            runtime.keep_own(why)
    return runtime(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


TRANSFORMERS_FLOOR = (5, 20)  # as pyproject.toml declares


def require_transformers() -> None:
    """Raise ImportError unless transformers is at least ``TRANSFORMERS_FLOOR``. pip checks the floor, but an install
    with ``--no-deps`` or an image's own copy does not: with transformers 5.17 (an H200 image's), Gemma-3-270M's
    dense answers past 8K tokens came out garbled ("tthe special magic numbers ffor ..."), where 5.24 answers."""
    import re
    from importlib.metadata import version

    found = version("transformers")
    if tuple(int(part) for part in re.findall(r"\d+", found)[:2]) < TRANSFORMERS_FLOOR:
        floor = ".".join(map(str, TRANSFORMERS_FLOOR))
        raise ImportError(
            f"openattention needs transformers>={floor}, found {found}: pip install -U 'transformers>={floor}'"
        )


def register() -> None:
    """Register the ``openattention`` attention (and sdpa's masks for it) with transformers. Idempotent."""
    require_transformers()
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, openattention_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, AttentionMaskInterface()["sdpa"])


class OpenAttentionHandle:
    """What ``oa.patch`` returns: the patched model's runtimes, their stats, and the way back (also as a context
    manager)."""

    def __init__(
        self, model, spec, dense_layers: Iterable[int], layer_specs: Mapping[int, Any] | None, question: Question
    ) -> None:
        attention = [m for m in model.modules() if is_causal_self_attention(m)]
        if not attention or not hasattr(model, "config"):
            raise TypeError(
                f"{type(model).__name__}: no causal self-attention layers found (modules with layer_idx, is_causal "
                "and scaling); OpenAttention patches decoder models whose attention goes through transformers' "
                "AttentionInterface"
            )
        self.model = model
        self.previous_implementation = model.config._attn_implementation
        self.num_layers = len(attention)
        self.dense_layers = set(dense_layers)
        for layer in self.dense_layers:
            self._check_layer(layer)
        self.runtimes = {module.layer_idx: LayerRuntime(module.layer_idx, None, question) for module in attention}
        # Layers that attend a sliding window keep the model's own attention: only full-attention layers go sparse.
        for module in attention:
            if why := window_reason(module):
                self.runtimes[module.layer_idx].keep_own(why)
        if all(runtime.keeps_own for runtime in self.runtimes.values()):
            warnings.warn(
                f"openattention: no layer of {type(model).__name__} can go sparse: every one keeps the model's own "
                f"attention ({self.runtimes[0].keeps_own})",
                RuntimeWarning,
                stacklevel=3,
            )
        self.use(spec, layer_specs)  # validates the specs before anything is registered
        for module in attention:
            _RUNTIMES[module] = self.runtimes[module.layer_idx]
        self._modules = attention

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise SpecError(f"layers: layer {layer} does not exist (the model has {self.num_layers})")

    def use(
        self, spec: PipelineSpec | Mapping | str | None = None, layer_specs: Mapping[int, Any] | None = None
    ) -> None:
        """Switch to another spec (and per-layer overrides), keeping the recorded contexts: a context prefilled once
        serves every spec."""
        layer_specs = dict(layer_specs or {})
        for layer in layer_specs:
            self._check_layer(layer)
        default = build(spec)
        pipelines = {layer: build(s) for layer, s in layer_specs.items()}
        for layer, runtime in self.runtimes.items():
            dense = layer in self.dense_layers or runtime.keeps_own is not None
            runtime.pipeline = None if dense else pipelines.get(layer, default)
            runtime.live = None
            if runtime.context is not None:  # states prepared for the old pipelines are never read again
                runtime.context.prepared.clear()

    def static_cache(self, max_new_tokens: int):
        """A static cache for the fast decode path: ``model.generate(..., max_new_tokens=n,
        cache=handle.static_cache(max_new_tokens=n))`` (``past_key_values=`` before transformers 5.24;
        ``oa.cache_kwargs`` names it for either). Its capacity is set at the prefill: the prompt plus
        ``max_new_tokens``; generating past it raises."""
        from oa_core.integration.static_cache import OACache

        return OACache(self.runtimes, max_new_tokens)

    @property
    def stats(self) -> GenerationStats:
        return GenerationStats([r for layer in sorted(self.runtimes) for r in self.runtimes[layer].records])

    def reset_stats(self) -> None:
        for runtime in self.runtimes.values():
            runtime.records.clear()

    def unpatch(self) -> None:
        unpatch(self.model)

    def __enter__(self) -> OpenAttentionHandle:
        return self

    def __exit__(self, *exc) -> None:
        unpatch(self.model)


def patch(
    model,
    spec: PipelineSpec | Mapping | str | None = None,
    *,
    dense_layers: Iterable[int] = (),
    layer_specs: Mapping[int, Any] | None = None,
    question: Question | None = None,
    setup: Literal["A", "B"] | None = None,
) -> OpenAttentionHandle:
    """Make ``model`` attend with OpenAttention, in place; returns a handle (``with oa.patch(model, spec): ...``).

    ``dense_layers``: layer indices that keep the model's own attention; ``layer_specs``: {layer: spec} overrides;
    ``question``: "sparse" (default) attends a question after a recorded context sparsely, in causal blocks;
    "dense" attends it with the model's own attention. ``setup``: the paper's names for the same, "B" and "A".
    """
    question = _question(question, setup)
    if model in _HANDLES:
        unpatch(model)
    handle = OpenAttentionHandle(model, spec, dense_layers, layer_specs, question)
    register()
    model.set_attn_implementation(IMPLEMENTATION)
    _HANDLES[model] = handle
    return handle


def unpatch(model) -> None:
    """Restore the attention implementation ``model`` had before ``oa.patch`` and drop the runtimes."""
    handle = _HANDLES.pop(model, None)
    if handle is None:
        return
    model.set_attn_implementation(handle.previous_implementation)
    for module in handle._modules:
        _RUNTIMES.pop(module, None)


def _question(question: str | None, setup: str | None) -> Question:
    """``question`` or its paper name ``setup``, checked before anything changes."""
    if setup is not None:
        if setup not in SETUPS:
            raise SpecError(f"setup: expected 'A' (question dense) or 'B' (question sparse), got {setup!r}")
        if question is not None and question != SETUPS[setup]:
            raise SpecError(f"setup {setup!r} means question={SETUPS[setup]!r}, not {question!r}: give one of them")
        return SETUPS[setup]
    if question is None or question == "sparse":
        return "sparse"
    if question == "dense":
        return "dense"
    raise SpecError(f"question: expected 'sparse' or 'dense', got {question!r}")


def runtimes(model) -> dict[int, LayerRuntime]:
    """The model's layer runtimes by layer index: those of ``oa.patch``, or those the ``attn_implementation=
    "openattention"`` route made at the first call."""
    return {module.layer_idx: _RUNTIMES[module] for module in model.modules() if module in _RUNTIMES}
