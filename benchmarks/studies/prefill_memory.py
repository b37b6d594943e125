"""One prefill attention call's GPU memory: an unpadded float32 prefill of grouped heads, transformers' ``sdpa`` as is
against OpenAttention's (``oa_core.integration.prefill.model_sdpa``, which spells out the causal mask there).

    python benchmarks/studies/prefill_memory.py          # 8192 tokens, 9 query heads on 3 KV heads, batch 1 and 4

Without a mask transformers passes the grouped heads to torch as they are (``enable_gqa``); in float32 on CUDA no
fused kernel takes that and the math kernel materialises the [B, Hq, N, N] scores. Per batch: the peak allocated above
the inputs for each call, and the largest difference between their outputs. Writes
``benchmarks/studies/results/prefill_memory_cuda.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

import oa_core as oa


def peak_gib(call) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, _ = call()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3), out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("QUERY", "KV"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/studies/results/prefill_memory_cuda.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefill_memory: needs a CUDA GPU (the math-kernel fallback it measures is CUDA's)")
    hq, hkv = args.heads
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=hq * 64,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        attn_implementation="sdpa",
    )
    layer = LlamaForCausalLM(config).model.layers[0].self_attn
    rows = []
    for batch in args.batch:
        query, key, value = (torch.randn(batch, h, args.length, 64, device="cuda") for h in (hq, hkv, hkv))
        sdpa = AttentionInterface()["sdpa"]
        plain, expected = peak_gib(functools.partial(sdpa, layer, query, key, value, None, scaling=0.125))
        ours, got = peak_gib(
            functools.partial(oa.integration.prefill.model_sdpa, layer, query, key, value, None, 0.125, 0.0)
        )
        rows.append(
            {
                "batch": batch,
                "length": args.length,
                "query_heads": hq,
                "kv_heads": hkv,
                "transformers_sdpa_gib": plain,
                "openattention_sdpa_gib": ours,
                "max_abs_diff": (got - expected).abs().max().item(),
            }
        )
        print(rows[-1])
        del expected, got
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
