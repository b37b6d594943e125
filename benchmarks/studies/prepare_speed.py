r"""Prepare on the GPU: where one layer's prepare goes, against the layer's dense prefill attention.

Shapes of Llama-3.1-8B (32 query / 8 KV heads, head dim 128, bf16), the library's default components at 1%, GQA
shared (``SPEC``; the record's ``spec`` names every param as it ran), batch × context. Per configuration, each stage
timed on its own (device synchronised around it, median of ``--repeats``), in the order prepare runs them:

- ``geometry``: the query second moment and its top-16 eigenpairs (``oa_core.ops.geometry.query_geometry``);
- ``cluster``: QGC without the geometry: the projection, k-means++ and Lloyd (``lloyd``);
- ``index``: the selector's index (PQS's centroids and codes; QGS's int8 codes when it was the default);
- ``pool``: the clusters' pooled sums (``PipelineState.start_clusters``);
- ``static``: the state moved into the fast path's buffers (``StaticState.from_state``), as the static cache does;
- ``prepare``: ``Pipeline.prepare`` end to end, and ``prepare + static`` as the static cache pays it per layer;
- ``dense_prefill_attention``: the layer's causal SDPA over the prompt (the model's prefill also runs the
  projections and the MLP: ``benchmarks/generate_speed.py`` measures the whole prefill).

``--data model`` takes each stage's inputs from a real prefill instead of random tensors: the keys, values and last
queries that a 4-layer model of the Llama-3.1-8B shape (random bf16 weights, ``benchmarks/generate_speed.py``'s)
hands each layer's prepare, stages timed per layer (median over the layers); and it times that model's prefill per
layer (4 layers less 2, halved), so that ``prepare_over_model_prefill`` is the issue's measure (prepare ≤ 10% of
the dense prefill).

Also the eigensolvers on the same batch of moments (B × 8 matrices of 128 × 128): LAPACK on the CPU (the copy there
and back included), ``torch.linalg.eigh`` on the GPU, and the subspace iteration, on the benchmark's random queries
(a flat spectrum: the iteration's worst case) and on queries with a decaying spectrum (0.9^i per dimension).
Writes ``benchmarks/studies/results/prepare_h200.json``.

    python benchmarks/studies/prepare_speed.py                      # 16x16K, 8x32K, 1x32K, 32x32K
    python benchmarks/studies/prepare_speed.py --configs 16x16384
    python benchmarks/studies/prepare_speed.py --data model --configs 16x16384 8x32768 \
        --out benchmarks/studies/results/prepare_h200_model.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import headline_scripts  # noqa: F401 (benchmarks/ on the path: the headline scripts import)
import oa_core as oa
from oa_core.analysis.provenance import provenance
from oa_core.ops import geometry
from oa_core.state import PipelineState
from oa_core.static import StaticState

SPEC = {"kernel": "flash", "gqa": "shared", "budget": {"density": 0.01}}  # the default components otherwise

HQ, HKV, D = 32, 8, 128


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["16x16384", "8x32768", "1x32768", "32x32768"],
        help="batch x context (default: %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per stage, median (default: %(default)s)")
    parser.add_argument(
        "--data",
        choices=["random", "model"],
        default="random",
        help="random tensors, or a real prefill's (default: %(default)s)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/studies/results/prepare_h200.json"))
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


def eigh_on_host(moment: torch.Tensor) -> list[torch.Tensor]:
    """LAPACK's eigenpairs: the matrices copied to the host, the pairs back to their device."""
    return [t.to(moment.device) for t in torch.linalg.eigh(moment.cpu())]


def eigensolvers(batch: int, device: torch.device, repeats: int) -> dict:
    """Milliseconds of each eigensolver on B × Hkv moments of 1024 query samples, flat and decaying spectra."""
    out = {}
    gen = torch.Generator(device=device).manual_seed(1)
    for name, spectrum in (("flat", torch.ones(D)), ("decaying", 0.9 ** torch.arange(D, dtype=torch.float64))):
        samples = torch.randn(batch * HKV, 1024, D, device=device, generator=gen, dtype=torch.float64)
        samples = samples * spectrum.to(device).sqrt()
        moment = samples.transpose(-1, -2) @ samples / 1024
        (exact, _), lapack_ms = timed(functools.partial(eigh_on_host, moment), repeats)
        _, gpu_ms = timed(functools.partial(torch.linalg.eigh, moment), repeats)
        (values, vectors), subspace_ms = timed(functools.partial(geometry.subspace_eigenpairs, moment, 16), repeats)
        residual = (moment @ vectors - vectors * values[..., None, :]).norm(dim=-2).max() / exact[..., -1].min()
        out[name] = {
            "matrices": batch * HKV,
            "lapack_cpu_ms": lapack_ms,
            "eigh_gpu_ms": gpu_ms,
            "subspace_gpu_ms": subspace_ms,
            "top16_value_rel_error": float(((values - exact[..., -16:]).abs() / exact[..., -1:]).max()),
            "residual_over_lambda1": float(residual),
        }
    return out


def random_inputs(batch: int, context: int, device: torch.device) -> list[tuple]:
    """One layer's prepare inputs, random: (keys, values, prefill queries, mask, scale)."""
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(batch, HKV, context, D, device=device, generator=gen, dtype=torch.bfloat16)
    values = torch.randn(batch, HKV, context, D, device=device, generator=gen, dtype=torch.bfloat16)
    prefill = torch.randn(batch, HQ, 256, D, device=device, generator=gen, dtype=torch.bfloat16)
    return [(keys, values, prefill, torch.ones(batch, context, dtype=torch.bool, device=device), D**-0.5)]


def model_inputs(batch: int, context: int, device: torch.device, repeats: int) -> tuple[list[tuple], float]:
    """Each layer's prepare inputs from the prefill of a 4-layer model of the 8B shape through ``oa.patch`` and its
    static cache, and that model's dense prefill per layer in milliseconds (4 layers less 2, halved)."""
    from generate_speed import build_model
    from oa_core.pipeline import Pipeline

    model = build_model(False, 4, device)
    ids = torch.randint(10, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    layers, prefill_ms = model.model.layers, {}
    with torch.no_grad():
        for count in (2, 4):
            model.model.layers = layers[:count]
            model(ids[:, :256], logits_to_keep=1)
            _, prefill_ms[count] = timed(lambda: model(ids, logits_to_keep=1), repeats)
    model.model.layers = layers
    captured, prepare = [], Pipeline.prepare

    def capture(pipe, keys, values, queries=None, scale=None, mask=None):
        captured.append((keys, values, queries.clone(), mask, scale))
        return prepare(pipe, keys, values, queries, scale, mask)

    handle = oa.patch(model, {"gqa": "shared", "budget": {"density": 0.01}})
    try:
        Pipeline.prepare = capture
        with torch.no_grad():
            model(ids, **oa.cache_kwargs(model, handle.static_cache(max_new_tokens=8)), logits_to_keep=1)
    finally:
        Pipeline.prepare = prepare
        handle.unpatch()
    return captured, (prefill_ms[4] - prefill_ms[2]) / 2


def layer_stages(pipe, inputs: tuple, repeats: int) -> dict:
    """Milliseconds of each stage of one layer's prepare."""
    keys, values, prefill, mask, scale = inputs
    batch, context = keys.shape[0], keys.shape[2]
    pipe.prepare(keys, values, prefill.clone(), scale, mask)  # warm-up: kernels compiled, allocator primed
    stages = {}
    queries = prefill.clone()  # one tensor: the geometry is computed once, then reused by the stages after it
    rank, window = pipe.clusterer.config.rank, pipe.clusterer.config.query_window
    _, stages["geometry"] = timed(lambda: geometry.query_geometry(keys, prefill.clone(), mask, rank, window), repeats)
    geometry.query_geometry(keys, queries, mask, rank, window)
    seed = torch.Generator()
    clusters, stages["cluster"] = timed(lambda: pipe.clusterer.fit(keys, queries, mask, seed.manual_seed(0)), repeats)
    index, stages["index"] = timed(lambda: pipe.selector.build(keys, queries, clusters), repeats)

    def pool():
        state = PipelineState(pipe, keys, values, mask, scale, torch.zeros(batch, dtype=torch.bool, device=keys.device))
        state.start_clusters(clusters, index)
        return state

    _, stages["pool"] = timed(pool, repeats)
    state, stages["prepare"] = timed(lambda: pipe.prepare(keys, values, prefill.clone(), scale, mask), repeats)
    _, stages["static"] = timed(lambda: StaticState.from_state(state, context + 64), repeats)
    stages["prepare_and_static"] = round(stages["prepare"] + stages["static"], 3)
    return stages


def run_config(batch: int, context: int, repeats: int, data: str) -> dict:
    device = torch.device("cuda")
    pipe = oa.build(SPEC)
    row = {"batch": batch, "context": context}
    if data == "model":
        layers, row["model_prefill_per_layer_ms"] = model_inputs(batch, context, device, repeats)
    else:
        layers = random_inputs(batch, context, device)
    per_layer = [layer_stages(pipe, inputs, repeats) for inputs in layers]
    stages = {name: statistics.median(s[name] for s in per_layer) for name in per_layer[0]}
    if len(per_layer) > 1:
        row["prepare_and_static_per_layer_ms"] = [s["prepare_and_static"] for s in per_layer]
    keys, values = layers[0][:2]
    gen = torch.Generator(device=device).manual_seed(0)
    q_prefill = torch.randn(batch, HQ, context, D, device=device, generator=gen, dtype=torch.bfloat16)
    _, stages["dense_prefill_attention"] = timed(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q_prefill, keys, values, is_causal=True, enable_gqa=True
        ),
        repeats,
    )
    row["stages_ms"] = stages
    row["prepare_over_prefill_attention"] = round(stages["prepare_and_static"] / stages["dense_prefill_attention"], 3)
    if "model_prefill_per_layer_ms" in row:
        row["prepare_over_model_prefill"] = round(stages["prepare_and_static"] / row["model_prefill_per_layer_ms"], 3)
    row["eigensolvers"] = eigensolvers(batch, device, repeats)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    record = {
        "benchmark": "prepare_speed",
        "shapes": {"query_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16"},
        "spec": oa.build(SPEC).resolved_spec(),
        "data": "random bf16 keys/values/prefill queries (seed 0)"
        if args.data == "random"
        else "each layer's prepare inputs from the prefill of a 4-layer Llama-3.1-8B-shaped model with random bf16 "
        "weights (seed 0)",
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "openattention": oa.__version__,
        },
        "runs": [],
        "provenance": provenance(torch.device("cuda")),
    }
    for config in args.configs:
        batch, context = (int(x) for x in config.lower().split("x"))
        row = run_config(batch, context, args.repeats, args.data)
        record["runs"].append(row)
        stages = ", ".join(f"{k} {v:.1f}" for k, v in row["stages_ms"].items())
        solvers = "; ".join(
            f"{k}: lapack {v['lapack_cpu_ms']:.1f}, gpu eigh {v['eigh_gpu_ms']:.1f}, subspace "
            f"{v['subspace_gpu_ms']:.1f} (residual {v['residual_over_lambda1']:.0e})"
            for k, v in row["eigensolvers"].items()
        )
        share = row.get("prepare_over_model_prefill")
        print(
            f"{batch}x{context}: {stages} ms; prepare/prefill attention {row['prepare_over_prefill_attention']:.2f}"
            + ("" if share is None else f"; prepare/model prefill {share:.3f} (target 0.10)")
            + f"; eigensolvers (ms) {solvers}",
            flush=True,
        )
        torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
