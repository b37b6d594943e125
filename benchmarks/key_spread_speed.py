"""What QGS's key spread costs on the GPU: one layer's ``Pipeline.prepare`` with ``key_rank`` 0 (the query basis) and 8
(the default), and ``geometry.with_key_spread`` alone, beside the layer's causal SDPA prefill attention; random bf16
tensors of Llama-3.1-8B's shape (32 query / 8 KV heads, head dim 128) and Gemma-3-270M's (4 / 1, 256); median of 5
runs, the device synchronised around each.

    python benchmarks/key_spread_speed.py         # benchmarks/results/key_spread_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import oa_core as oa
from oa_core import geometry

SHAPES = (("llama-3.1-8b", 32, 8, 128, 16, 16384), ("llama-3.1-8b", 32, 8, 128, 8, 32768),
          ("llama-3.1-8b", 32, 8, 128, 1, 32768), ("gemma-3-270m", 4, 1, 256, 4, 16384),
          ("gemma-3-270m", 4, 1, 256, 2, 32768))


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
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/key_spread_h200.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda")
    rows = []
    for model, hq, hkv, d, batch, n in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        keys, values = (torch.randn(batch, hkv, n, d, device=device, generator=gen, dtype=torch.bfloat16)
                        for _ in range(2))
        prefill = torch.randn(batch, hq, 256, d, device=device, generator=gen, dtype=torch.bfloat16)
        mask = torch.ones(batch, n, dtype=torch.bool, device=device)
        row = {"model": model, "batch": batch, "context": n}
        for key_rank in (0, 8):
            pipe = oa.build({"kernel": "flash", "gqa": "shared", "budget": {"density": 0.01},
                             "selector": {"name": "qgs", "rank": 16, "rerank": 4, "key_rank": key_rank}})
            row[f"prepare_key_rank_{key_rank}_ms"] = timed(lambda: pipe.prepare(keys, values, prefill.clone(),
                                                                                d ** -0.5, mask))
        basis = torch.linalg.qr(torch.randn(batch, hkv, d, 8, device=device, generator=gen)).Q
        row["with_key_spread_ms"] = timed(lambda: geometry.with_key_spread(basis, keys, mask, 8))
        queries = torch.randn(batch, hq, n, d, device=device, generator=gen, dtype=torch.bfloat16)
        k, v = keys.repeat_interleave(hq // hkv, 1), values.repeat_interleave(hq // hkv, 1)
        row["sdpa_prefill_attention_ms"] = timed(
            lambda: torch.nn.functional.scaled_dot_product_attention(queries, k, v, is_causal=True), 3)
        print(row, flush=True)
        rows.append(row)
        del keys, values, prefill, queries, k, v
        torch.cuda.empty_cache()
    result = {"benchmark": "key_spread_speed", "device": torch.cuda.get_device_name(), "rows": rows,
              "versions": {"torch": torch.__version__, "python": platform.python_version()}}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
