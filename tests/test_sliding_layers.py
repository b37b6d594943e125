"""Models that mix sliding-window and full-attention layers (Gemma 3), or slide every layer (Mistral): the sliding
layers keep the model's own attention and the stats say so; only full-attention layers go sparse."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

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


def generate(model, length=120, tokens=6):
    ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False, pad_token_id=0
        )
    return out[:, length:]


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
    for layer in (1, 3):
        decode = decode_records(stats, layer)
        assert decode and not any(r.dense for r in decode)
        assert all(float(r.density) < 1.0 for r in decode)


def test_mistral_slides_every_layer_and_none_goes_sparse_without_a_window():
    with oa.patch(tiny_mistral(window=32), SPARSE) as handle:
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
