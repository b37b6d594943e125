"""Which decoders OpenAttention patches, and how each layer attends: tiny random models of transformers'
architectures (2 layers, seed 0) on the CPU, patched through ``oa.patch``.

    python benchmarks/architectures.py          # about a minute on 2 CPU cores; writes architectures.json

For each architecture: at a budget that covers the context, a patched model must generate the unpatched model's
tokens on the default cache and on OpenAttention's static cache; at 20% (QGC's 8 clusters), the layers that decode
sparsely, and those that keep the model's own attention with the reason the stats give. An architecture that cannot
be patched records its error. ``benchmarks/results_tables.py`` renders the JSON in docs/integration.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

import oa_core as oa
from oa_core.analysis.provenance import provenance
from oa_core.integration.runtime import is_causal_self_attention

OUT = Path(__file__).resolve().parent / "results" / "architectures.json"
FULL = {"budget": {"density": 1.0}}
SPARSE = {"clusterer": {"name": "qgc", "num_clusters": 8}, "sink": 2, "local": 8, "budget": {"density": 0.2}}
PROMPT, TOKENS = 100, 5
# Every config: 2 layers of 4 query heads on 2 KV heads, a vocabulary of 96; a window of 32 where a layer slides.
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
COMMON.update(num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MIXED = dict(sliding_window=32, layer_types=["sliding_attention", "full_attention"])
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# model_type → its own config keywords (beside COMMON, where the config takes them).
ARCHITECTURES: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=32),
    "mixtral": MOE,
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "phi": {},
    "phi3": {},
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, **MIXED, attn_logit_softcapping=50.0),
    "gemma3_text": dict(head_dim=16, **MIXED),
    "olmo2": {},
    "cohere": {},
    "granite": {},
    "starcoder2": {},
    "stablelm": {},
    "smollm3": {},
    "falcon": {},
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024),
    "gpt_neox": {},
    "opt": dict(ffn_dim=96, word_embed_proj_dim=64),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
    "gpt_oss": dict(head_dim=16, **MIXED, **MOE),
    "deepseek_v3": dict(
        num_key_value_heads=4,  # latent attention: a KV head per query head
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
    ),
}


def tiny(model_type: str):
    """The architecture's tiny model (seed 0), in sdpa where it takes it, else eager."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    defaults = CONFIG_MAPPING[model_type]()
    common = {name: value for name, value in COMMON.items() if hasattr(defaults, name)}
    config = CONFIG_MAPPING[model_type](**{**common, **ARCHITECTURES[model_type]})
    torch.manual_seed(0)
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    except ValueError:  # no sdpa (Gemma 2, gpt-oss): their eager attention
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def generate(model, handle=None) -> torch.Tensor:
    ids = torch.randint(3, 96, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = oa.cache_kwargs(model, handle.static_cache(max_new_tokens=TOKENS)) if handle is not None else {}
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False, **cache
        )
    return out[:, PROMPT:]


def check(model_type: str) -> dict:
    """One architecture's record (its error, where it has one)."""
    record: dict = {"model_type": model_type}
    try:
        model = tiny(model_type)
        expected = generate(model)
        with oa.patch(model, FULL) as handle:
            record["attention"] = next(type(m).__name__ for m in model.modules() if is_causal_self_attention(m))
            record["implementation"] = handle.previous_implementation
            record["layers"] = handle.num_layers
            record["full_budget_same_tokens"] = {
                "default cache": bool(torch.equal(generate(model), expected)),
                "static cache": bool(torch.equal(generate(model, handle), expected)),
            }
        with oa.patch(model, SPARSE) as handle:
            generate(model)
            generate(model, handle)  # OpenAttention's static cache runs too
            decode = [r for r in handle.stats.records if r.phase == "decode"]
        record["sparse_layers"] = sorted({r.layer for r in decode if not r.dense})
        kept = collections.defaultdict(set)
        for r in decode:
            if r.dense:
                kept[r.reason].add(r.layer)
        record["kept_own"] = {reason: sorted(layers) for reason, layers in sorted(kept.items())}
        record["error"] = None
    except Exception as error:  # recorded: an architecture we cannot patch says why
        record["error"] = f"{type(error).__name__}: {error}"
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(ARCHITECTURES), help="these architectures alone")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    records = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in tqdm(args.only or list(ARCHITECTURES), desc="architectures", unit="model"):
            records.append(check(model_type))
    result = {
        "benchmark": "architectures",
        "setup": {"prompt": PROMPT, "new_tokens": TOKENS, "sparse_spec": SPARSE, "config": COMMON},
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "records": records,
        "provenance": provenance("cpu"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for r in records:
        print(json.dumps(r))
    failed = [r["model_type"] for r in records if r["error"] or not all(r["full_budget_same_tokens"].values())]
    print(f"{len(records) - len(failed)} of {len(records)} architectures patched as unpatched at a full budget")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
