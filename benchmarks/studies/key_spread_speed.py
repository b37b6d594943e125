"""What QGS's key spread costs on the GPU: one layer's ``Pipeline.prepare`` with ``key_rank`` 0 (the query basis) and 8
(the default), and ``geometry.with_key_spread`` alone, beside the layer's causal SDPA prefill attention; random bf16
tensors of Llama-3.1-8B's shape (32 query / 8 KV heads, head dim 128) and Gemma-3-270M's (4 / 1, 256); median of 5
runs, the device synchronised around each.

Random keys are the subspace iteration's worst case: their covariance off the query subspace is nearly flat, and
the iteration runs 56–80 products where real keys' decaying spectra stop it at its minimum of 16 (SmolLM2 and
Gemma-3-270M keys at 4K, on the CPU). ``--model`` measures on a real model's keys instead: one prefill of ``--length``
tokens of the essays, each full-attention layer's captured keys, values and last queries through ``prepare``, beside
the whole model's prefill (its forward pass with a cache, as ``generate`` runs it).

    python benchmarks/studies/key_spread_speed.py            # benchmarks/studies/results/key_spread_h200.json
    python benchmarks/studies/key_spread_speed.py --model gemma3-270m --length 32768  # key_spread_gemma3_270m_h200.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import oa_core as oa
from oa_core.ops import geometry

SHAPES = (
    ("llama-3.1-8b", 32, 8, 128, 16, 16384),
    ("llama-3.1-8b", 32, 8, 128, 8, 32768),
    ("llama-3.1-8b", 32, 8, 128, 1, 32768),
    ("gemma-3-270m", 4, 1, 256, 4, 16384),
    ("gemma-3-270m", 4, 1, 256, 2, 32768),
)


def timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: benchmarks/studies/results/key_spread_h200.json, or key_spread_MODEL_h200.json",
    )
    parser.add_argument("--model", default=None, help="an offline model (gemma3-270m, smollm2-135m): its real keys")
    parser.add_argument("--length", type=int, default=32768, help="the context with --model (default: 32768)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    if args.length < 2 * geometry.QUERY_WINDOW:
        parser.error(f"--length must be at least {2 * geometry.QUERY_WINDOW}")
    if args.model is not None:
        result = real_keys(args.model, args.length)
        name = f"key_spread_{args.model.replace('-', '_').replace('.', '_')}_h200.json"
    else:
        result = random_keys()
        name = "key_spread_h200.json"
    result.update(
        device=torch.cuda.get_device_name(), versions={"torch": torch.__version__, "python": platform.python_version()}
    )
    out = args.out or Path("benchmarks/studies/results") / name
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def pipeline(key_rank: int) -> oa.Pipeline:
    return oa.build(
        {
            "kernel": "flash",
            "gqa": "shared",
            "budget": {"density": 0.01},
            "selector": {"name": "qgs", "rank": 16, "rerank": 4, "key_rank": key_rank},
        }
    )


def prepare_ms(pipe: oa.Pipeline, keys, values, prefill, scale, mask) -> float:
    """``pipe.prepare`` on the tensors, each run on its own copy of the prefill queries: median milliseconds."""
    return timed(lambda: pipe.prepare(keys, values, prefill.clone(), scale, mask))


def real_keys(model_name: str, length: int, device: str = "cuda") -> dict:
    """Per full-attention layer of ``model_name`` at ``length`` tokens: ``prepare`` with key_rank 0 and 8 and
    ``with_key_spread`` alone on its captured tensors; and the whole model's prefill."""
    from oa_core.analysis.attention_error import haystack_ids
    from oa_core.analysis.offline_model import capture_attention, load_offline_model

    model, tokenizer = load_offline_model(model_name)
    model = model.to(device)
    ids = haystack_ids(tokenizer, length).to(device)
    with torch.no_grad():
        prefill_ms = timed(lambda: model(input_ids=ids, use_cache=True), 3)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    layers = [i for i, kind in enumerate(types) if kind == "full_attention"]  # the layers OpenAttention makes sparse
    captured = capture_attention(model, ids, layers)
    rows = []
    for layer in layers:
        queries, keys, values, scale = captured.pop(layer)
        prefill = queries[:, :, -geometry.QUERY_WINDOW :].contiguous()
        mask = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device)
        row = {"layer": layer}
        for key_rank in (0, 8):
            row[f"prepare_key_rank_{key_rank}_ms"] = prepare_ms(pipeline(key_rank), keys, values, prefill, scale, mask)
        basis, _ = geometry.query_geometry(keys, prefill, mask, 8, geometry.QUERY_WINDOW)
        row["with_key_spread_ms"] = timed(functools.partial(geometry.with_key_spread, basis, keys, mask, 8))
        print(row, flush=True)
        rows.append(row)
    total = {f"prepare_key_rank_{k}_ms": round(sum(r[f"prepare_key_rank_{k}_ms"] for r in rows), 2) for k in (0, 8)}
    return {
        "benchmark": "key_spread_speed",
        "model": model_name,
        "context": length,
        "batch": 1,
        "data": "the essays haystack from its first character",
        "dtype": str(next(model.parameters()).dtype),
        "model_prefill_ms": prefill_ms,
        "sparse_layers": layers,
        "rows": rows,
        "all_sparse_layers": total,
    }


def random_keys() -> dict:
    """Every shape in SHAPES on random bf16 tensors."""
    device = torch.device("cuda")
    rows = []
    for model, hq, hkv, d, batch, n in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        keys, values = (
            torch.randn(batch, hkv, n, d, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2)
        )
        prefill = torch.randn(batch, hq, 256, d, device=device, generator=gen, dtype=torch.bfloat16)
        mask = torch.ones(batch, n, dtype=torch.bool, device=device)
        row = {"model": model, "batch": batch, "context": n}
        for key_rank in (0, 8):
            row[f"prepare_key_rank_{key_rank}_ms"] = prepare_ms(
                pipeline(key_rank), keys, values, prefill, d**-0.5, mask
            )
        basis = torch.linalg.qr(torch.randn(batch, hkv, d, 8, device=device, generator=gen)).Q
        row["with_key_spread_ms"] = timed(functools.partial(geometry.with_key_spread, basis, keys, mask, 8))
        queries = torch.randn(batch, hq, n, d, device=device, generator=gen, dtype=torch.bfloat16)
        k, v = keys.repeat_interleave(hq // hkv, 1), values.repeat_interleave(hq // hkv, 1)
        row["sdpa_prefill_attention_ms"] = timed(
            functools.partial(torch.nn.functional.scaled_dot_product_attention, queries, k, v, is_causal=True), 3
        )
        print(row, flush=True)
        rows.append(row)
        del keys, values, prefill, queries, k, v
        torch.cuda.empty_cache()
    return {"benchmark": "key_spread_speed", "rows": rows}


if __name__ == "__main__":
    raise SystemExit(main())
