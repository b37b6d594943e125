"""The reference pipeline on CUDA against the same pipeline on the CPU, at Llama-3.1-8B decode shapes.

Not a speed benchmark (the flash kernel's is): it checks that every stage runs on the GPU and gives the CPU's
answer — same clusters, same selection, outputs within float32 / bf16 rounding — with no NaN. Writes
benchmarks/results/cuda_consistency.json.

    python benchmarks/cuda_consistency.py          # needs a CUDA device
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import oa_core as oa

SHAPE = dict(batch=2, kv_heads=8, group=4, tokens=8192, dim=128, decode=4)


def inputs(dtype: torch.dtype, seed: int = 0):
    """Clustered keys (real caches are clustered), values, prefill and decode queries on the CPU."""
    s = SHAPE
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(s["batch"], s["kv_heads"], 48, s["dim"], generator=gen) * 2
    member = torch.randint(48, (s["batch"], s["kv_heads"], s["tokens"]), generator=gen)
    keys = centres.gather(2, member[..., None].expand(-1, -1, -1, s["dim"]))
    keys = keys + torch.randn(keys.shape, generator=gen)
    values = torch.randn(keys.shape, generator=gen)
    heads = s["kv_heads"] * s["group"]
    prefill = torch.randn(s["batch"], heads, 256, s["dim"], generator=gen)
    decode = torch.randn(s["batch"], heads, s["decode"], s["dim"], generator=gen)
    return [t.to(dtype) for t in (keys, values, prefill, decode)]


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    records = []
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        cpu_inputs = inputs(dtype)
        gpu_inputs = [t.cuda() for t in cpu_inputs]
        for spec in ({}, {"gqa": "shared"}, {"tail": "discard", "selector": "oracle", "allocator": "global"},
                     {"tail": "sample"}):
            pipe = oa.build({**spec, "budget": {"density": 0.03}})
            out_cpu, stats_cpu = pipe.attend(cpu_inputs[3], pipe.prepare(*cpu_inputs[:3]), return_stats=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            state = pipe.prepare(*gpu_inputs[:3])
            out_gpu, stats_gpu = pipe.attend(gpu_inputs[3], state, return_stats=True)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            same_clusters = torch.equal(state.pooled.assignment.cpu(),
                                        pipe.prepare(*cpu_inputs[:3]).pooled.assignment)
            error = float((out_gpu.cpu().float() - out_cpu.float()).norm() / out_cpu.float().norm())
            # Tail samples come from the device's own generator, so only the sample tail may differ by device.
            comparable = spec.get("tail") != "sample"
            record = {"dtype": str(dtype), "spec": spec, "relative_difference": error, "tolerance": tolerance,
                      "same_clusters": same_clusters, "finite": bool(torch.isfinite(out_gpu).all()),
                      "density_cpu": stats_cpu.density, "density_gpu": stats_gpu.density,
                      "gpu_prepare_plus_attend_s": round(seconds, 3),
                      "ok": bool(torch.isfinite(out_gpu).all()) and (error < tolerance or not comparable)}
            records.append(record)
            print(json.dumps(record))
    result = {"benchmark": "cuda_consistency", "shape": SHAPE, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "records": records, "all_ok": all(r["ok"] for r in records)}
    out = Path("benchmarks/results/cuda_consistency.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("all ok" if result["all_ok"] else "MISMATCH")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
