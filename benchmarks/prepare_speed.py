"""Prepare on the GPU: where one layer's prepare goes, against the layer's dense prefill attention.

Shapes of Llama-3.1-8B (32 query / 8 KV heads, head dim 128, bf16), the default pipeline (QGC 64 clusters at rank
16, QGS rank 16, 1%), batch × context. Per configuration, each stage timed on its own (device synchronised around
it, median of ``--repeats``), in the order prepare runs them:

- ``geometry``: the query second moment and its top-16 eigenpairs (``oa_core.geometry.query_geometry``);
- ``cluster``: QGC without the geometry: the projection, k-means++ and Lloyd (``lloyd``);
- ``index``: QGS's int8 codes; ``pool``: the clusters' pooled sums (``PipelineState.start_clusters``);
- ``static``: the state moved into the fast path's buffers (``StaticState.from_state``), as the static cache does;
- ``prepare``: ``Pipeline.prepare`` end to end, and ``prepare + static`` as the static cache pays it per layer;
- ``dense_prefill_attention``: the layer's causal SDPA over the prompt (the model's prefill also runs the
  projections and the MLP: ``benchmarks/generate_speed.py`` measures the whole prefill).

Also the eigensolvers on the same batch of moments (B × 8 matrices of 128 × 128): LAPACK on the CPU (the copy there
and back included), ``torch.linalg.eigh`` on the GPU, and the subspace iteration, on the benchmark's random queries
(a flat spectrum: the iteration's worst case) and on queries with a decaying spectrum (0.9^i per dimension).
Writes ``benchmarks/results/prepare_h200.json``.

    python benchmarks/prepare_speed.py                      # 16x16K, 8x32K, 1x32K, 32x32K
    python benchmarks/prepare_speed.py --configs 16x16384
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import oa_core as oa
from oa_core import geometry
from oa_core.state import PipelineState
from oa_core.static import StaticState

HQ, HKV, D = 32, 8, 128


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["16x16384", "8x32768", "1x32768", "32x32768"],
                        help="batch x context (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per stage, median (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prepare_h200.json"))
    return parser.parse_args(argv)


def timed(fn, repeats: int) -> tuple[object, float]:
    """(fn's last result, median milliseconds), the device synchronised around each call."""
    times, result = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return result, round(statistics.median(times), 3)


def eigensolvers(batch: int, device: torch.device, repeats: int) -> dict:
    """Milliseconds of each eigensolver on B × Hkv moments of 1024 query samples, flat and decaying spectra."""
    out = {}
    gen = torch.Generator(device=device).manual_seed(1)
    for name, spectrum in (("flat", torch.ones(D)), ("decaying", 0.9 ** torch.arange(D, dtype=torch.float64))):
        samples = torch.randn(batch * HKV, 1024, D, device=device, generator=gen, dtype=torch.float64)
        samples = samples * spectrum.to(device).sqrt()
        moment = samples.transpose(-1, -2) @ samples / 1024
        (exact, _), lapack_ms = timed(lambda: [t.to(device) for t in torch.linalg.eigh(moment.cpu())], repeats)
        _, gpu_ms = timed(lambda: torch.linalg.eigh(moment), repeats)
        (values, vectors), subspace_ms = timed(lambda: geometry.subspace_eigenpairs(moment, 16), repeats)
        residual = (moment @ vectors - vectors * values[..., None, :]).norm(dim=-2).max() / exact[..., -1].min()
        out[name] = {"matrices": batch * HKV, "lapack_cpu_ms": lapack_ms, "eigh_gpu_ms": gpu_ms,
                     "subspace_gpu_ms": subspace_ms,
                     "top16_value_rel_error": float(((values - exact[..., -16:]).abs() / exact[..., -1:]).max()),
                     "residual_over_lambda1": float(residual)}
    return out


def run_config(batch: int, context: int, repeats: int) -> dict:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(batch, HKV, context, D, device=device, generator=gen, dtype=torch.bfloat16)
    values = torch.randn(batch, HKV, context, D, device=device, generator=gen, dtype=torch.bfloat16)
    prefill = torch.randn(batch, HQ, 256, D, device=device, generator=gen, dtype=torch.bfloat16)
    pipe = oa.build({"kernel": "flash", "gqa": "shared", "budget": {"density": 0.01}})
    mask = torch.ones(batch, context, dtype=torch.bool, device=device)
    pipe.prepare(keys, values, prefill.clone())  # warm-up: kernels compiled, allocator primed
    row = {"batch": batch, "context": context}
    stages = {}
    queries = prefill.clone()  # one tensor: the geometry is computed once, then reused by the stages after it
    rank, window = pipe.clusterer.config.rank, pipe.clusterer.config.query_window
    _, stages["geometry"] = timed(lambda: geometry.query_geometry(keys, prefill.clone(), mask, rank, window), repeats)
    geometry.query_geometry(keys, queries, mask, rank, window)
    seed = torch.Generator()
    clusters, stages["cluster"] = timed(lambda: pipe.clusterer.fit(keys, queries, mask, seed.manual_seed(0)), repeats)
    index, stages["index"] = timed(lambda: pipe.selector.build(keys, queries, clusters), repeats)

    def pool():
        state = PipelineState(pipe, keys, values, mask, D ** -0.5, torch.zeros(batch, dtype=torch.bool,
                                                                               device=device))
        state.start_clusters(clusters, index)
        return state

    _, stages["pool"] = timed(pool, repeats)
    state, stages["prepare"] = timed(lambda: pipe.prepare(keys, values, prefill.clone()), repeats)
    _, stages["static"] = timed(lambda: StaticState.from_state(state, context + 64), repeats)
    stages["prepare_and_static"] = round(stages["prepare"] + stages["static"], 3)
    q_prefill = torch.randn(batch, HQ, context, D, device=device, generator=gen, dtype=torch.bfloat16)
    _, stages["dense_prefill_attention"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
        q_prefill, keys, values, is_causal=True, enable_gqa=True), repeats)
    row["stages_ms"] = stages
    row["prepare_over_prefill_attention"] = round(stages["prepare_and_static"] / stages["dense_prefill_attention"], 3)
    row["eigensolvers"] = eigensolvers(batch, device, repeats)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    record = {"benchmark": "prepare_speed", "shapes": {"query_heads": HQ, "kv_heads": HKV, "head_dim": D,
                                                       "dtype": "bfloat16"},
              "spec": "default (qgc 64 clusters rank 16, qgs rank 16), density 0.01, gqa shared",
              "data": "random bf16 keys/values/prefill queries (seed 0)",
              "machine": {"gpu": torch.cuda.get_device_name(), "python": platform.python_version(),
                          "torch": torch.__version__, "triton": triton.__version__, "openattention": oa.__version__},
              "runs": []}
    for config in args.configs:
        batch, context = (int(x) for x in config.lower().split("x"))
        row = run_config(batch, context, args.repeats)
        record["runs"].append(row)
        stages = ", ".join(f"{k} {v:.1f}" for k, v in row["stages_ms"].items())
        solvers = "; ".join(f"{k}: lapack {v['lapack_cpu_ms']:.1f}, gpu eigh {v['eigh_gpu_ms']:.1f}, subspace "
                            f"{v['subspace_gpu_ms']:.1f} (residual {v['residual_over_lambda1']:.0e})"
                            for k, v in row["eigensolvers"].items())
        print(f"{batch}x{context}: {stages} ms; prepare/prefill attention {row['prepare_over_prefill_attention']:.2f}"
              f"; eigensolvers (ms) {solvers}", flush=True)
        torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
