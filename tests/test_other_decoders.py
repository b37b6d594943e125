"""Decoders other than Llama's family. GPT-2, GPT-NeoX and OPT write their attention without ``num_key_value_groups``
(one KV head per query head): patched, they generate as unpatched at a budget that covers the context, and decode
sparsely at a smaller one, on either cache. DeepSeek's latent attention has values narrower than its keys, and
Falcon's ALiBi adds a bias to the mask, which no pipeline takes: their layers keep the model's own attention and say
why."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import oa_core as oa

SPARSE = {"clusterer": {"name": "qgc", "num_clusters": 8}, "sink": 2, "local": 8, "budget": {"density": 0.2}}
FULL = {"budget": {"density": 1.0}}
SIZES = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "gpt_neox": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
    "opt": dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64),
}
LATENT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
LATENT.update(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
LATENT.update(first_k_dense_replace=1)
LATENT.update(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)


def tiny(kind):
    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, vocab_size=96, pad_token_id=0, **SIZES.get(kind, LATENT))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def generate(model, handle=None, length=100, tokens=5, logits=False):
    """Greedy tokens after a prompt of ``length`` (on ``handle``'s static cache where given), or each step's logits."""
    ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(1))
    kwargs = oa.cache_kwargs(model, handle.static_cache(max_new_tokens=tokens)) if handle is not None else {}
    if logits:
        kwargs.update(output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False, **kwargs
        )
    return torch.cat(out.logits) if logits else out[:, length:]


@pytest.mark.parametrize("kind", sorted(SIZES))
def test_a_decoder_without_kv_groups_is_patched_and_decodes_sparsely(kind):
    model = tiny(kind)
    assert not any(hasattr(m, "num_key_value_groups") for m in model.modules())
    expected = generate(model)
    with oa.patch(model, FULL) as handle:
        assert handle.num_layers == 2
        assert torch.equal(generate(model), expected)
        assert torch.equal(generate(model, handle), expected)
    with oa.patch(model, SPARSE) as handle:
        generate(model)
        decode = [r for r in handle.stats.records if r.phase == "decode"]
    assert len(decode) == 2 * 4 and not any(r.dense for r in decode)
    assert all(0.19 <= float(r.density) <= 0.2 for r in decode)


def test_latent_attention_keeps_the_models_own_and_says_why():
    model = tiny("deepseek_v3")
    expected = generate(model)
    with oa.patch(model, SPARSE) as handle, pytest.warns(RuntimeWarning, match="values of 12 dims beside keys of 24"):
        assert torch.equal(generate(model), expected)
        assert torch.equal(generate(model, handle), expected)
        records = handle.stats.records
    why = "dense: values of 12 dims beside keys of 24, which the pipelines do not take (the model's own attention)"
    assert records and all(r.dense and r.reason == why for r in records)


def test_a_bias_in_the_mask_keeps_the_models_own_attention():
    torch.manual_seed(0)
    config = AutoConfig.for_model("falcon", vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    config.update(dict(alibi=True, new_decoder_architecture=False, multi_query=False, pad_token_id=0))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    expected = generate(model, logits=True)
    with oa.patch(model, SPARSE) as handle, pytest.warns(RuntimeWarning, match="a bias in the attention mask"):
        torch.testing.assert_close(generate(model, logits=True), expected)
        records = handle.stats.records
    assert records and all(r.dense and r.reason.startswith("dense: a bias in the attention mask") for r in records)


def test_the_architectures_benchmark_records_a_sparse_and_a_kept_model(tmp_path):
    from conftest import load_benchmark

    architectures = load_benchmark("architectures")
    out = tmp_path / "architectures.json"
    assert architectures.main(["--only", "llama", "gemma2", "--out", str(out)]) == 0
    llama, gemma2 = json.loads(out.read_text())["records"]
    assert llama["full_budget_same_tokens"] == {"default cache": True, "static cache": True}
    assert llama["sparse_layers"] == [0, 1] and llama["kept_own"] == {}
    assert gemma2["sparse_layers"] == [] and list(gemma2["kept_own"].values()) == [[0, 1]]
    assert next(iter(gemma2["kept_own"])).startswith("dense: logit soft-capping (softcap=50)")
