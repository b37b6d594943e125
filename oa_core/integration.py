"""OpenAttention inside transformers' ``generate()``, through the public ``AttentionInterface``.

    handle = oa.patch(model, {"budget": {"density": 0.03}})   # or: with oa.patch(model, spec): ...
    model.generate(**inputs)                                 # dense prefill, then sparse question and decode
    print(handle.stats.summary())
    oa.unpatch(model)                                        # the model's own attention again

An attention function registered under ``"openattention"`` replaces the model's implementation (set with the public
``set_attn_implementation``; nothing else in the model changes). Per attention layer a ``LayerRuntime`` keeps the
pipeline state beside the cache. transformers hands the attention function the whole cache of a layer, not the cache
object, so the runtime recognises its request from the keys themselves:

- a call with no past (prefill of a context) runs the model's own ``sdpa`` and records the context: keys, values,
  the padding mask and the last prefill queries (QGC's query geometry); the pipeline state is prepared from it at
  the first sparse call, once per spec;
- a call on top of a cache it knows (the live state, or a recorded context, checked by length and by a few key
  rows) continues it: new rows are appended and attended sparsely — a question in blocks of at most ``local``
  tokens, causally (setup B), or densely (setup A: only the tokens after the first decoded one are sparse);
- a call on a cache it has not seen prepares from that cache (no prefill queries: QGC falls back to the keys).

Layers in ``dense_layers`` always run the model's own attention; ``layer_specs`` gives a layer its own spec.
"""

from __future__ import annotations

import contextlib
import copy
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from oa_core.pipeline import CacheMismatch, Pipeline, PipelineState, build, probe_rows
from oa_core.spec import PipelineSpec, SpecError

IMPLEMENTATION = "openattention"
PREFILL_QUERY_WINDOW = 256

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


class Span:
    """A stretch of a layer call: host time on the CPU; on a GPU two CUDA events, read only when asked (one wait
    then), so that timing every layer call never makes the host wait for the device."""

    def __init__(self, like: Tensor) -> None:
        self._device = like.device if like.is_cuda else None
        self._start = self._mark()
        self._end = None

    def stop(self) -> Span:
        self._end = self._mark()
        return self

    def __float__(self) -> float:
        if self._device is None:
            return self._end - self._start
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000

    def _mark(self):
        if self._device is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))  # the stream the layer's work goes to
        return event


@dataclass
class StepRecord:
    """One attention call of one layer. Its density, proxy count and times are read (from the device) when asked:
    recording a decode step never waits on the device."""

    layer: int
    phase: str  # "prefill" | "question" | "decode"
    position: int  # tokens already cached before the call
    tokens: int  # T
    density_total: Tensor | float  # exact rows read over the valid context (1.0 when dense), summed over the blocks
    proxies_total: Tensor | float  # proxies per (query, selection head), summed over the call's blocks
    blocks: int  # the call's causal blocks
    dense: bool
    reason: str
    prepare_span: Span | float
    attend_span: Span | float

    @property
    def density(self) -> float:
        """Exact rows read over the valid context (1.0 when dense), mean over the call's blocks."""
        return float(self.density_total) / max(self.blocks, 1)

    @property
    def proxies(self) -> float:
        """Proxies per (query, selection head), mean."""
        return float(self.proxies_total) / max(self.blocks, 1)

    @property
    def prepare_s(self) -> float:
        return float(self.prepare_span)

    @property
    def attend_s(self) -> float:
        return float(self.attend_span)


class LayerRuntime:
    """One attention layer's OpenAttention: the pipeline, the recorded context and the live (growing) state."""

    def __init__(self, layer: int, pipeline: Pipeline | None, setup: Literal["A", "B"]) -> None:
        self.layer = layer
        self.pipeline = pipeline  # None: this layer stays dense
        self.setup = setup
        self.context: ContextRecord | None = None
        self.live: PipelineState | None = None
        self.records: list[StepRecord] = []

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        T, N = query.shape[2], key.shape[2]
        past = N - T
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        if self.pipeline is None or past == 0:
            out, weights = _sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            if self.pipeline is not None:
                self._record_context(query, key, value, attention_mask, scale)
            self._log("prefill", past, T, dense=True, reason="dense prefill" if self.pipeline else "dense layer")
            return out, weights

        while True:
            prepare = Span(key)
            state = self._state_for(key, value, past, scale, attention_mask)
            prepare.stop()
            try:
                return self._attend(state, prepare, module, query, key, value, attention_mask, scaling, dropout,
                                    **kwargs)
            except CacheMismatch:  # raised by the first growth, before anything changed
                if state is not self.live:
                    raise
                self.live = None  # a cache of the live state's length, other rows: not its continuation

    def _attend(self, state: PipelineState, prepare: Span, module, query, key, value, attention_mask, scaling,
                dropout, **kwargs):
        T, past = query.shape[2], key.shape[2] - query.shape[2]
        phase = "question" if T > 1 else "decode"
        attend = Span(key)
        if state.plan().all_dense or (phase == "question" and self.setup == "A"):
            state.grow_to(key, value)
            out, weights = _sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            self.live = state
            reason = "dense: setup A question" if phase == "question" and self.setup == "A" else "dense: budget >= context"
            self._log(phase, past, T, dense=True, reason=reason, prepare=prepare, attend=attend.stop())
            return out, weights
        outputs, stats = [], []
        block = max(self.pipeline.spec.local, 1)
        for first in range(0, T, block):  # a question attends in causal blocks that fit the local window
            last = min(first + block, T)
            state.grow_to(key[:, :, :past + last], value[:, :, :past + last])  # the cache's rows, not a copy
            out, step = self.pipeline.attend(query[:, :, first:last], state, return_stats=True, causal=True)
            outputs.append(out)
            stats.append(step)
        self.live = state
        proxies = [s.proxies.float().mean() for s in stats if s.proxies is not None]
        self._log(phase, past, T, dense=False, reason=stats[-1].reason, prepare=prepare, attend=attend.stop(),
                  density=sum(s.density_tensor for s in stats), proxies=sum(proxies) if proxies else 0.0,
                  blocks=len(stats))
        return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None

    def _record_context(self, query: Tensor, key: Tensor, value: Tensor, attention_mask, scale: float) -> None:
        mask = _key_mask(attention_mask, key)
        # The window is cut before the product: a slice of the product would keep all N queries alive (per layer,
        # for as long as the context is kept).
        window = slice(-PREFILL_QUERY_WINDOW, None)
        queries = query[:, :, window] * mask[:, None, window, None]
        self.context = ContextRecord(key, value, queries, mask, scale)
        self.live = None

    def _state_for(self, key: Tensor, value: Tensor, past: int, scale: float, attention_mask) -> PipelineState:
        """The state this call continues: the live one, a fork of the recorded context's, or a new one. The live
        state is taken by its length alone (no wait on the device at every step): its growth then checks the rows
        and raises CacheMismatch if they are another cache's."""
        if self.live is not None and self.live.pipeline is self.pipeline and _same_length(self.live.keys, key, past):
            return self.live
        context = self.context
        if context is not None and _same_prefix(context.keys, key, past):
            state = context.prepared.get(id(self.pipeline))
            if state is None or state.pipeline is not self.pipeline:
                state = self.pipeline.prepare(context.keys, context.values, context.queries, context.scale,
                                              mask=context.mask)
                context.prepared[id(self.pipeline)] = state
            return state.fork()
        # A cache this runtime never saw prefilled (e.g. built before patching): no prefill queries to use; the
        # padding comes from this call's mask.
        return self.pipeline.prepare(key[:, :, :past], value[:, :, :past], None, scale,
                                     mask=_key_mask(attention_mask, key)[:, :past])

    def _log(self, phase: str, past: int, tokens: int, dense: bool, reason: str, prepare: Span | float = 0.0,
             attend: Span | float = 0.0, density: Tensor | float = 1.0, proxies: Tensor | float = 0.0,
             blocks: int = 1) -> None:
        self.records.append(StepRecord(self.layer, phase, past, tokens, density, proxies, blocks, dense, reason,
                                       prepare, attend))


def _same_length(known: Tensor, key: Tensor, past: int) -> bool:
    """Whether ``key``'s first ``past`` rows can be the ``known`` cache: same batch, heads, length and device."""
    return known.shape[2] == past and known.shape[:2] == key.shape[:2] and known.device == key.device


def _same_prefix(known: Tensor, key: Tensor, past: int) -> bool:
    """Whether ``key``'s first ``past`` rows are the ``known`` cache: same length, same rows at a few positions."""
    if not _same_length(known, key, past):
        return False
    probe = probe_rows(past)
    return torch.equal(known[:, :, probe], key[:, :, probe])


def _key_mask(attention_mask: Tensor | None, key: Tensor) -> Tensor:
    """``[B, N]`` valid keys from a 4D prefill mask (the last query row sees every valid key); all True if None."""
    if attention_mask is None:
        return torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
    row = attention_mask[:, 0, -1, -key.shape[2]:]
    # A copy, never a view: the recorded context would keep the whole [B, 1, N, N] mask alive.
    return row.clone() if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2


def _sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """transformers' ``sdpa``; an unpadded float32 prefill of grouped heads on CUDA gets its causal mask spelled out.
    Without a mask transformers hands torch the key/value groups as they are (``enable_gqa``), which no fused CUDA
    kernel takes in float32: the math kernel's [B, Hq, N, N] scores took 5.4 GiB per 8K layer call with SmolLM2's 9
    heads on 3 (20.7 at batch 4), and 15 ranks sharing one H200 ran out of memory in their prefills. With a mask it
    repeats the heads and torch's memory-efficient kernel runs. Not on the CPU, where the grouped call is the faster
    one (2.5× at 4K)."""
    from transformers import AttentionInterface

    if attention_mask is None and _grouped_float32_cuda_prefill(module, query, key, kwargs):
        attention_mask = _causal_mask(query.shape[2], query.device)
    return AttentionInterface()["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)


def _grouped_float32_cuda_prefill(module, query: Tensor, key: Tensor, kwargs: Mapping[str, Any]) -> bool:
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    return (bool(causal) and query.is_cuda and query.dtype == torch.float32 and key.shape[1] < query.shape[1]
            and query.shape[2] == key.shape[2] > 1)


def _causal_mask(length: int, device: torch.device | str) -> Tensor:
    """``[1, 1, N, N]`` boolean: query i sees keys 0..i (sdpa's ``is_causal`` for a prefill with no past)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def openattention_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered with ``AttentionInterface``: query ``[B, Hq, T, D]``, key/value ``[B, Hkv, N, D]``
    (the layer's whole cache) → (output ``[B, T, Hq, D]``, None)."""
    runtime = _RUNTIMES.get(module)
    if runtime is None:  # the attn_implementation= route: the spec from config.openattention, or the defaults
        spec = getattr(module.config, "openattention", None)
        runtime = _RUNTIMES[module] = LayerRuntime(module.layer_idx, build(spec), "B")
    return runtime(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register() -> None:
    """Register the ``openattention`` attention (and sdpa's masks for it) with transformers. Idempotent."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, openattention_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, AttentionMaskInterface()["sdpa"])


@dataclass
class GenerationStats:
    """Per layer and call: read density, proxies, time in prepare vs attend (``records``), with summaries."""

    records: list[StepRecord]

    def sparse(self) -> list[StepRecord]:
        return [r for r in self.records if not r.dense]

    @property
    def density(self) -> float:
        """Mean read density of the sparse calls (1.0 if none was sparse)."""
        sparse = self.sparse()
        return sum(r.density for r in sparse) / len(sparse) if sparse else 1.0

    def density_by_layer(self) -> dict[int, float]:
        layers: dict[int, list[float]] = {}
        for r in self.records:
            layers.setdefault(r.layer, []).append(r.density)
        return {layer: sum(d) / len(d) for layer, d in sorted(layers.items())}

    @property
    def prepare_seconds(self) -> float:
        return sum(r.prepare_s for r in self.records)

    @property
    def attend_seconds(self) -> float:
        return sum(r.attend_s for r in self.records)

    def summary(self) -> str:
        sparse = self.sparse()
        reasons = sorted({r.reason for r in self.records if r.phase != "prefill"})
        proxies = sum(r.proxies for r in sparse) / len(sparse) if sparse else 0.0
        return (f"{len(sparse)} sparse and {len(self.records) - len(sparse)} dense layer calls; read density "
                f"{self.density:.4f} (sparse calls), {proxies:.1f} proxies per query head; prepare "
                f"{self.prepare_seconds:.2f} s, sparse attend {self.attend_seconds:.2f} s; {'; '.join(reasons)}")


class OpenAttentionHandle:
    """What ``oa.patch`` returns: the patched model's runtimes, their stats, and the way back (also as a context
    manager)."""

    def __init__(self, model, spec, dense_layers: Iterable[int], layer_specs: Mapping[int, Any] | None,
                 setup: Literal["A", "B"]) -> None:
        if setup not in ("A", "B"):
            raise SpecError(f"setup: expected 'A' (question dense) or 'B' (question sparse), got {setup!r}")
        attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
        if not attention or not hasattr(model, "config"):
            raise TypeError(f"{type(model).__name__}: no attention layers with layer_idx found; OpenAttention patches "
                            "decoder models whose attention goes through transformers' AttentionInterface")
        self.model = model
        self.previous_implementation = model.config._attn_implementation
        self.num_layers = len(attention)
        self.dense_layers = set(dense_layers)
        for layer in self.dense_layers:
            self._check_layer(layer)
        self.runtimes = {module.layer_idx: LayerRuntime(module.layer_idx, None, setup) for module in attention}
        self.use(spec, layer_specs)  # validates the specs before anything is registered
        for module in attention:
            _RUNTIMES[module] = self.runtimes[module.layer_idx]
        self._modules = attention

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise SpecError(f"layers: layer {layer} does not exist (the model has {self.num_layers})")

    def use(self, spec: PipelineSpec | Mapping | str | None = None, layer_specs: Mapping[int, Any] | None = None) -> None:
        """Switch to another spec (and per-layer overrides), keeping the recorded contexts: a context prefilled once
        serves every spec."""
        layer_specs = dict(layer_specs or {})
        for layer in layer_specs:
            self._check_layer(layer)
        default = build(spec)
        pipelines = {layer: build(s) for layer, s in layer_specs.items()}
        for layer, runtime in self.runtimes.items():
            runtime.pipeline = None if layer in self.dense_layers else pipelines.get(layer, default)
            runtime.live = None
            if runtime.context is not None:  # states prepared for the old pipelines are never read again
                runtime.context.prepared.clear()

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


def patch(model, spec: PipelineSpec | Mapping | str | None = None, *, dense_layers: Iterable[int] = (),
          layer_specs: Mapping[int, Any] | None = None, setup: Literal["A", "B"] = "B") -> OpenAttentionHandle:
    """Make ``model`` attend with OpenAttention, in place; returns a handle (``with oa.patch(model, spec): ...``).

    ``dense_layers``: layer indices that keep the model's own attention; ``layer_specs``: {layer: spec} overrides;
    ``setup``: "B" (default) decodes the question sparsely, "A" attends it densely.
    """
    if model in _HANDLES:
        unpatch(model)
    handle = OpenAttentionHandle(model, spec, dense_layers, layer_specs, setup)
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


@dataclass
class Context:
    """A context prefilled once (densely); every ``generate_from_context`` call works on its own copy of the cache."""

    input_ids: Tensor
    attention_mask: Tensor
    cache: Any


def cache_kwargs(model, cache) -> dict[str, Any]:
    """The cache as the model's forward names it: ``cache`` since transformers 5.24, ``past_key_values`` before."""
    import inspect

    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def _output_cache(output) -> Any:
    return output.cache if hasattr(output, "cache") else output.past_key_values


def prefill_context(model, input_ids: Tensor, attention_mask: Tensor | None = None) -> Context:
    """Dense prefill of ``input_ids`` ``[B, N]`` (left-padded batches: pass ``attention_mask``) → a reusable Context.

    Prefill the context with the model patched (``oa.patch``) so each layer records what its pipelines need."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask),
                    use_cache=True, **_last_logits_only(model))
    return Context(input_ids, attention_mask, _output_cache(out))


def positions(attention_mask: Tensor) -> Tensor:
    """Position ids that count valid tokens only, as ``generate`` derives them: a left-padded row's first real token
    is at 0, so its context, question and answer agree with each other (RoPE sees true distances)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def _last_logits_only(model) -> dict[str, Any]:
    """``logits_to_keep=1`` where the model takes it: a prefill needs the cache, not [B, N, vocab] logits."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@contextlib.contextmanager
def _continuation(model, context: Context, question_ids: Tensor):
    """(ids, mask, a copy of the context's cache) for one continuation of ``context``. Afterwards the layers let go
    of their live states: they point into that copy, which nothing can continue, so it is freed at once instead of
    living on beside the next continuation's copy."""
    ids = torch.cat([context.input_ids, question_ids], dim=1)
    mask = torch.cat([context.attention_mask, torch.ones_like(question_ids)], dim=1)
    try:
        yield ids, mask, copy.deepcopy(context.cache)
    finally:
        handle = _HANDLES.get(model)
        for runtime in handle.runtimes.values() if handle is not None else ():
            runtime.live = None


def generate_from_context(model, context: Context, question_ids: Tensor, **generate_kwargs) -> Tensor:
    """Greedy (by default) generation after ``context`` + ``question_ids`` ``[B, Q]``, the context's cache copied
    and reused → the new tokens ``[B, L]``."""
    generate_kwargs.setdefault("do_sample", False)
    with _continuation(model, context, question_ids) as (ids, mask, cache), torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), **generate_kwargs)
    return out[:, ids.shape[1]:]


def answer_logprob(model, context: Context, question_ids: Tensor, answer_ids: Tensor,
                   answer_mask: Tensor | None = None) -> Tensor:
    """Teacher-forced log-likelihood of ``answer_ids`` ``[B, A]`` after context + question → ``[B]`` (nats).

    ``answer_mask`` ``[B, A]``: answers of different lengths in one batch, right-padded (False: padding, not
    counted; a causal model's real tokens never see it)."""
    tail = torch.cat([question_ids, answer_ids], dim=1)
    with _continuation(model, context, question_ids) as (_, mask, cache), torch.no_grad():
        mask = torch.cat([mask, torch.ones_like(answer_ids)], dim=1)
        logits = model(input_ids=tail, attention_mask=mask, position_ids=positions(mask)[:, -tail.shape[1]:],
                       use_cache=True, **cache_kwargs(model, cache)).logits
    predicted = logits[:, question_ids.shape[1] - 1:-1].float().log_softmax(-1)
    token = predicted.gather(-1, answer_ids[..., None]).squeeze(-1)
    return (token if answer_mask is None else token * answer_mask).sum(-1)
