"""Layers that keep the model's own attention, and the stats say why: sliding-window layers beside full-attention ones
(Gemma 3), every layer sliding (Mistral), attention whose math is more than a softmax over the mask (Gemma 2's logit
soft-capping, gpt-oss's sink logits), on the default cache and on the static one. Only full softmax layers go sparse."""

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import oa_core as oa

SPARSE = {"clusterer": {"name": "qgc", "num_clusters": 8}, "sink": 2, "local": 8, "budget": {"density": 0.2}}


def tiny_gemma3(window=16):
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    return Gemma3ForCausalLM(config).eval()


def tiny_mistral(window):
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=window,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    return MistralForCausalLM(config).eval()


def tiny_own_math(kind):
    """Two layers (sliding, full) whose attention has math of its own, strong enough to change the next-token logits:
    gpt-oss's sink logits (set to 3), or Gemma 2's attention logits capped at 2. Eager attention: neither model takes
    sdpa."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    sizes.update(num_key_value_heads=2, head_dim=16, sliding_window=16, max_position_embeddings=1024)
    if kind == "sinks":
        config = GptOssConfig(**sizes, num_local_experts=2, num_experts_per_tok=1, attn_implementation="eager")
        model = GptOssForCausalLM(config).eval()
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(3.0)
        return model
    config = Gemma2Config(**sizes, attn_logit_softcapping=2.0, attn_implementation="eager")
    model = Gemma2ForCausalLM(config).eval()
    for layer in model.model.layers:  # attention logits well past the cap
        layer.self_attn.q_proj.weight.data *= 30
    return model


def without_own_math(model):
    """The same model with its attention's own math switched off (what sdpa would compute)."""
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            layer.self_attn.sinks.data.fill_(float("-inf"))  # e^{-inf}: no sink
        else:
            layer.self_attn.attn_logit_softcapping = None
    return model


def generate(model, length=120, tokens=6, **kwargs):
    ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out if kwargs.get("return_dict_in_generate") else out[:, length:]


def static_generate(model, handle, tokens=6, **kwargs):
    cache = oa.cache_kwargs(model, handle.static_cache(max_new_tokens=tokens))
    return generate(model, tokens=tokens, **cache, **kwargs)


def logits(out):
    """generate's tokens and each step's next-token logits ``[steps, vocab]``."""
    return out.sequences, torch.cat(out.logits)


def decode_records(stats, layer):
    return [r for r in stats.records if r.layer == layer and r.phase == "decode"]


def test_gemma3_sliding_layers_keep_their_attention_and_full_layers_go_sparse():
    model = tiny_gemma3()
    expected = generate(model, tokens=1)
    with oa.patch(model, SPARSE) as handle:
        first = generate(model, tokens=1)  # the prefill's next token: every layer dense
        generate(model)
        stats = handle.stats
    assert torch.equal(first, expected)
    for layer in (0, 2):
        records = [r for r in stats.records if r.layer == layer]
        assert records and all(
            r.dense and r.reason == "dense: sliding window of 16 (the model's own attention)" for r in records
        )
        assert [r.phase for r in records] == ["prefill", "prefill", *["decode"] * 5]  # two prompts, five steps
    for layer in (1, 3):
        decode = decode_records(stats, layer)
        assert decode and not any(r.dense for r in decode)
        assert all(float(r.density) < 1.0 for r in decode)


def test_mistral_slides_every_layer_and_none_goes_sparse_without_a_window():
    with pytest.warns(RuntimeWarning, match="no layer of MistralForCausalLM can go sparse"):
        handle = oa.patch(tiny_mistral(window=32), SPARSE)
    with handle:
        generate(handle.model)
        stats = handle.stats
    assert stats.records and all(r.dense and "sliding window of 32" in r.reason for r in stats.records)
    with oa.patch(tiny_mistral(window=None), SPARSE) as handle:
        generate(handle.model)
        decode = [r for r in handle.stats.records if r.phase == "decode"]
    assert decode and not any(r.dense for r in decode)


@pytest.mark.parametrize("kind", ["chunked_attention"])
def test_another_local_layer_type_is_named_as_it_is(kind):
    model = tiny_gemma3()
    module = model.model.layers[0].self_attn
    module.config.layer_types = [kind, *module.config.layer_types[1:]]
    assert oa.integration.runtime.window_reason(module) == f"dense: {kind} (the model's own attention)"


def test_a_static_cache_keeps_the_sliding_window_after_the_prompt():
    model = tiny_gemma3()
    expected = generate(model)
    with oa.patch(model, SPARSE, dense_layers=[1, 3]) as handle:  # every layer the model's: its own tokens
        assert torch.equal(static_generate(model, handle), expected)
    with oa.patch(model, SPARSE) as handle:  # the full layers sparse: the static step as the default cache's
        assert torch.equal(static_generate(model, handle), generate(model))
        decode = decode_records(handle.stats, 1)
    assert decode and not any(r.dense for r in decode)


@pytest.mark.parametrize("kind", ["sinks", "softcap"])
def test_attention_with_math_of_its_own_keeps_the_models_own(kind):
    model, scores = tiny_own_math(kind), dict(output_logits=True, return_dict_in_generate=True)
    tokens, expected = logits(generate(model, **scores))
    with oa.patch(model, SPARSE) as handle, pytest.warns(RuntimeWarning, match="a layer keeps the model's own"):
        for out in (generate(model, **scores), static_generate(model, handle, **scores)):
            torch.testing.assert_close(logits(out), (tokens, expected))
        records = handle.stats.records
    assert model.config._attn_implementation == "eager"
    what = "learned sink logits (s_aux=a tensor)" if kind == "sinks" else "logit soft-capping (softcap=2)"
    assert records and all(r.dense and r.reason.startswith(f"dense: {what}") for r in records)
    ablated = torch.cat(generate(without_own_math(model), **scores).logits)
    assert (ablated - expected).abs().max() > 1e-3  # the math matters to these logits


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({}, None),
        ({"softcap": None, "s_aux": None}, None),
        ({"softcap": 0.0}, None),
        ({"softcap": 50.0}, "dense: logit soft-capping (softcap=50)"),
        ({"sinks": torch.zeros(4)}, "dense: learned sink logits (sinks=a tensor)"),
    ],
)
def test_own_math_names_the_keyword_it_cannot_model(kwargs, reason):
    why = oa.integration.prefill.own_math(kwargs)
    assert why == reason if reason is None else why.startswith(reason)
