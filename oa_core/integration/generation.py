"""Prefill a context once, then answer many questions from copies of its cache — what the demo, the needle and the
RULER harnesses do with one prefill per sample and many methods.

    context = oa.prefill_context(model, context_ids)                 # dense, once per sample
    handle.use(spec)                                                 # then per method:
    shared, rest = oa.share_question(model, context, question_ids)   # the question's leading blocks, attended once
    new = oa.generate_from_context(model, shared, rest, max_new_tokens=32)
    logprob = oa.answer_logprob(model, shared, rest, answer_ids)    # the same as from (context, question_ids)
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from oa_core.integration.runtime import runtimes
from oa_core.state import PipelineState


@dataclass
class Context:
    """A context prefilled once (densely); every ``generate_from_context`` call works on its own copy of the cache."""

    input_ids: Tensor
    attention_mask: Tensor
    cache: Any
    # A context extended past its prefill (``extend_context``): each sparse layer's state after it, which every
    # continuation starts from (a copy of); its pipeline is the spec it was extended under.
    states: dict[int, PipelineState] | None = None


def cache_kwargs(model, cache) -> dict[str, Any]:
    """The cache as the model's forward and ``generate`` name it: ``cache`` since transformers 5.24 (which deprecates
    ``past_key_values``, to be removed in 6.0), ``past_key_values`` before. ``model.generate(**inputs,
    **oa.cache_kwargs(model, handle.static_cache(max_new_tokens=32)))`` works on either."""
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
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions(attention_mask),
            use_cache=True,
            **_last_logits_only(model),
        )
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
    layers = runtimes(model)
    for layer, state in (context.states or {}).items():
        if state.pipeline is not layers[layer].pipeline:
            raise ValueError(
                f"this context was extended (extend_context) under another spec than layer {layer}'s "
                "now: extend the prefilled context again after handle.use"
            )
    try:
        for layer, state in (context.states or {}).items():
            layers[layer].live = state.fork()
        yield ids, mask, copy.deepcopy(context.cache)
    finally:
        for runtime in layers.values():
            runtime.live = None


def extend_context(model, context: Context, tokens: Tensor) -> Context:
    """``context`` continued by ``tokens`` ``[B, T]``, attended as the model is patched now (a question's tokens:
    sparsely in causal blocks, or densely in setup A) → a Context whose continuations start after them, from the
    layers' states as they left them. Valid for the spec in use: after ``handle.use`` extend the prefill again."""
    if tokens.dim() != 2 or tokens.shape[0] != context.input_ids.shape[0] or tokens.shape[1] == 0:
        raise ValueError(
            f"extend_context: expected tokens [B={context.input_ids.shape[0]}, T >= 1], got {tuple(tokens.shape)}"
        )
    with _continuation(model, context, tokens) as (ids, mask, cache), torch.no_grad():
        out = model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions(mask)[:, -tokens.shape[1] :],
            use_cache=True,
            **cache_kwargs(model, cache),
            **_last_logits_only(model),
        )
        states = {layer: runtime.live for layer, runtime in runtimes(model).items() if runtime.live is not None}
    return Context(ids, mask, _output_cache(out), states)


def shared_question_tokens(model, question_tokens: int) -> int:
    """How many leading tokens of a ``question_tokens``-long question a generation and a scoring of its answer can
    attend once, together (``share_question``): whole causal blocks of every sparse layer — each continuation then
    attends the rest in the very blocks it would have attended alone — and at most all but two, so that the rest is
    still a question (more than one token), never a decode step. 0: nothing to share."""
    block = 1
    for runtime in runtimes(model).values():
        if runtime.pipeline is not None and runtime.question == "sparse":
            block = math.lcm(block, max(runtime.pipeline.spec.local, 1))
    return max(question_tokens - 2, 0) // block * block


def share_question(model, context: Context, question_ids: Tensor) -> tuple[Context, Tensor]:
    """(``context`` extended by the question's first ``shared_question_tokens``, the rest of the question): generate
    from them and score the answer after them as from ``context`` and the whole question, the shared blocks attended
    once instead of twice."""
    shared = shared_question_tokens(model, question_ids.shape[1])
    if shared == 0:
        return context, question_ids
    return extend_context(model, context, question_ids[:, :shared]), question_ids[:, shared:]


def generate_from_context(model, context: Context, question_ids: Tensor, **generate_kwargs) -> Tensor:
    """Greedy (by default) generation after ``context`` + ``question_ids`` ``[B, Q]``, the context's cache copied
    and reused → the new tokens ``[B, L]``."""
    generate_kwargs.setdefault("do_sample", False)
    with _continuation(model, context, question_ids) as (ids, mask, cache), torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), **generate_kwargs)
    return out[:, ids.shape[1] :]


def answer_logprob(
    model, context: Context, question_ids: Tensor, answer_ids: Tensor, answer_mask: Tensor | None = None
) -> Tensor:
    """Teacher-forced log-likelihood of ``answer_ids`` ``[B, A]`` after context + question → ``[B]`` (nats).

    ``answer_mask`` ``[B, A]``: answers of different lengths in one batch, right-padded (False: padding, not
    counted; a causal model's real tokens never see it)."""
    tail = torch.cat([question_ids, answer_ids], dim=1)
    with _continuation(model, context, question_ids) as (_, mask, cache), torch.no_grad():
        mask = torch.cat([mask, torch.ones_like(answer_ids)], dim=1)
        logits = model(
            input_ids=tail,
            attention_mask=mask,
            position_ids=positions(mask)[:, -tail.shape[1] :],
            use_cache=True,
            **cache_kwargs(model, cache),
        ).logits
    predicted = logits[:, question_ids.shape[1] - 1 : -1].float().log_softmax(-1)
    token = predicted.gather(-1, answer_ids[..., None]).squeeze(-1)
    return (token if answer_mask is None else token * answer_mask).sum(-1)
