"""What does the default's static state hold beside the KV cache, as a share of the cache's bytes?

Issue 57's `generate` runs on an 80 GB H100 (`benchmarks/results/generate_speed_h100.json`) ran out of memory in the
prefill with the default per head where dense decoding fitted: what OpenAttention keeps beyond dense is each layer's
``StaticState`` (``oa_core.static``), built from the prefill. This study patches a Llama-3.1-8B-shaped model with
``--layers`` layers (the attention's shape: 32 query heads, 8 KV heads, head dim 128; random bf16 weights, a small
MLP and vocabulary, since they do not touch the state), prefills random prompts through ``handle.static_cache`` on the
CPU, and sums each layer's state by tensor (each storage once; the cache's own K and V left out) against the layer's K
and V at the cache's capacity. The shares do not depend on the batch; the pooled sums' share falls with the context
(a fixed number of clusters).

    python benchmarks/studies/state_memory.py                          # batch 1, 8K and 16K tokens, 1%
    python benchmarks/studies/state_memory.py --contexts 32768 --density 0.03
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import oa_core as oa
from oa_core.analysis.provenance import provenance

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "openattention.yaml"


def storages(obj, seen: set, depth: int = 0) -> list[tuple[str, int]]:
    """(name, bytes) of every tensor storage reachable from ``obj``'s fields (dataclasses, tuples, lists, dicts,
    objects' attributes; not its pipeline), each storage once (``seen``: storages already counted)."""
    if torch.is_tensor(obj):
        pointer = obj.untyped_storage().data_ptr()
        if pointer in seen:
            return []
        seen.add(pointer)
        return [("", obj.untyped_storage().nbytes())]
    if depth > 4 or id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    elif isinstance(obj, dict):
        items = list(obj.items())
    elif hasattr(obj, "__dataclass_fields__"):
        items = [(name, getattr(obj, name)) for name in obj.__dataclass_fields__]
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).items())
    else:
        return []
    found = []
    for name, item in items:
        if name != "pipeline":
            found += [(f"{name}.{sub}".rstrip("."), size) for sub, size in storages(item, seen, depth + 1)]
    return found


def measure(context: int, density: float, layers: int, batch: int) -> dict:
    config = LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=1024,
        vocab_size=1024,
        max_position_embeddings=max(8192, 2 * context),
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    spec = {**oa.load_spec(SPEC).model_dump(mode="json"), "budget": {"density": density}}
    ids = torch.randint(10, config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    with oa.patch(model, spec) as handle, torch.no_grad():
        cache = handle.static_cache(max_new_tokens=2)
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=0,
            **oa.cache_kwargs(model, cache),
        )
    layer = cache.layers[0]
    if layer.state is None:
        raise SystemExit(f"context {context} at {density:.0%}: the layer decodes densely ({layer.dense_reason})")
    kv = 2 * layer.keys.numel() * layer.keys.element_size()
    state = layer.state
    arena = {
        name: math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        for name, (_, dtype, shape) in state.layout.items()
    }
    seen = {t.untyped_storage().data_ptr() for t in (layer.keys, layer.values, state.arena)}
    found = [("arena", state.arena.untyped_storage().nbytes()), *storages(state, seen)]
    total = sum(size for _, size in found)
    return {
        "context": context,
        "batch": batch,
        "density": density,
        "kv_bytes_per_layer": kv,
        "state_bytes_per_layer": total,
        "state_over_kv": round(total / kv, 4),
        "arena_over_kv": {name: round(size / kv, 4) for name, size in sorted(arena.items(), key=lambda i: -i[1])},
        "storages_over_kv": {name: round(size / kv, 4) for name, size in sorted(found, key=lambda i: -i[1])[:8]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "studies" / "results" / "state_memory.json")
    args = parser.parse_args(argv)
    rows = [measure(n, args.density, args.layers, args.batch) for n in args.contexts]
    for row in rows:
        parts = ", ".join(f"{name} {share:.2%}" for name, share in row["arena_over_kv"].items() if share >= 0.0005)
        head = f"{row['context']:>7} tokens at {row['density']:.0%}: state {row['state_over_kv']:.1%} of K and V"
        print(f"{head} ({parts})")
        print("        its largest storages: " + ", ".join(f"{k} {v:.2%}" for k, v in row["storages_over_kv"].items()))
    result = {"what": __doc__.split("\n\n")[0], "spec": "specs/openattention.yaml", "rows": rows}
    result["provenance"] = provenance(torch.device("cpu"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
