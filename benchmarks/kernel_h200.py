"""Decode-attention speed on the GPU: the whole sparse stage against dense SDPA.

Shapes of Llama-3.1-8B decode (32 query / 8 KV heads, head dim 128, bf16, one query per row), batch × context ×
density. Per configuration, timed with ``triton.testing.do_bench`` (median) in one run:
- dense: ``scaled_dot_product_attention(..., enable_gqa=True)`` over the whole cache;
- the sparse stage's parts, each the pipeline's own code: scores (selector), allocation (cluster statistics and the
  allocator), selection (per-cluster top-q), kernel (flash); and ``attend`` end to end;
- bytes: what dense reads (K and V), what the sparse stage must read at least (exact rows, int8 codes, a 1-byte
  cluster id per token, pooled sums) and the floor time of those bytes at the bandwidth dense reached in this run.
Also prepare (clustering + index) per layer against the layer's dense causal prefill attention, and a decode step's
growth outside attend (one token appended, the plan rebuilt) against dense decode.

Correctness first: at every shape flash is checked against the torch reference (relative error) on a fresh,
NaN-poisoned output. Writes benchmarks/results/kernel_h200.json and prints a table.

    python benchmarks/kernel_h200.py                                # the full grid (on the device)
    python benchmarks/kernel_h200.py --batch 32 --context 32768 --density 0.01 0.03
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

import oa_core as oa
from oa_core.analysis.provenance import provenance
from oa_core.ops.cluster_stats import cluster_logit_stats
from oa_core.ops.selection import select, select_by_sorting
from oa_core.ops.water_filling import WaterFillAllocator
from oa_core.pipeline import Pipeline
from oa_core.static import StaticState
from oa_plugins.kernels.reference import TorchKernel

HQ, HKV, D = 32, 8, 128


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--density", type=float, nargs="+", default=[0.1, 0.05, 0.03, 0.01])
    parser.add_argument("--gqa", nargs="+", default=["shared"], choices=["shared", "per_head"])
    parser.add_argument("--clusters", type=int, default=64)
    parser.add_argument(
        "--spec",
        type=Path,
        default=None,
        help="a spec file whose selector, allocator, tail, proxy, sink and local replace the defaults' "
        "(the clusters, kernel, GQA and budget still come from the options above)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernel_h200.json"))
    return parser.parse_args(argv)


def bench(fn) -> float:
    """Median milliseconds."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median"))


def graphed(fn):
    """``fn`` captured in a CUDA graph → its replay: GPU time without the host's launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def kernel_breakdown(fn, repeats: int = 10) -> dict[str, float]:
    """GPU milliseconds per kernel name for one call of ``fn`` (torch.profiler, averaged over ``repeats``): where
    the time of a stage goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.split("(")[0].split("<")[0].removeprefix("void ")[:60]
            totals[name] = totals.get(name, 0.0) + event.device_time / 1e3 / repeats
    return {k: round(v, 4) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def decode_inputs(batch: int, context: int, device: torch.device):
    """The benchmark's inputs at one shape (seed 0): random bf16 keys and values ``[batch, 8, context, 128]``, 256
    prefill queries, and a decode query near some keys, so that attention is peaked as in a real model."""
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(batch, HKV, context, D, device=device, generator=gen, dtype=torch.bfloat16)
    values = torch.randn(batch, HKV, context, D, device=device, generator=gen, dtype=torch.bfloat16)
    prefill = torch.randn(batch, HQ, 256, D, device=device, generator=gen, dtype=torch.bfloat16)
    query = (keys[:, torch.arange(HQ, device=device) // (HQ // HKV), -7] * 1.5).unsqueeze(2).contiguous()
    return keys, values, prefill, query


def one_token_past(state):
    """A prepared state in static buffers at a capacity of N + 64, one more token written (its key and value 0.9× the
    last one's) and counted → (the static state, (cache keys, cache values), the new token's (key, value),
    ``restore``): ``restore()`` puts back the counts and sums a step grows, so that the same step can run again and
    again (timed, captured; the restoring copies are counted in)."""
    keys, values = state.keys, state.values
    B, H, n, D_ = keys.shape
    new_k, new_v = keys[:, :, -1:] * 0.9, values[:, :, -1:] * 0.9
    cache_k = torch.cat([keys, new_k, keys.new_zeros(B, H, 63, D_)], dim=2)
    cache_v = torch.cat([values, new_v, values.new_zeros(B, H, 63, D_)], dim=2)
    static = StaticState.from_state(state, n + 64)
    static.length += 1
    grown = (
        static.member_counts,
        static.pooled.count,
        static.pooled.key_sum,
        static.pooled.value_sum,
        static.pooled.key_square_sum,
    )
    saved = [t.clone() for t in grown]

    def restore():
        for tensor, value in zip(grown, saved):
            tensor.copy_(value)

    return static, (cache_k, cache_v), (new_k, new_v), restore


def repeated_fused_step(pipe: Pipeline, keys, values, prefill, query):
    """The fused static step of ``one_token_past`` the prepared inputs → (the static state, the cache's keys and
    values, ``run``): each ``run()`` restores what the step grew and runs it again."""
    static, cache, _, restore = one_token_past(pipe.prepare(keys, values, prefill))

    def run():
        restore()
        return static.fused.run(static, query, *cache)

    return static, cache, run


def sparse_bytes(batch: int, context: int, rows: int, clusters: int, rank: int) -> int:
    """The least the sparse stage reads per step: exact K and V rows (bf16), int8 codes + a float32 scale and a
    one-byte cluster id per token, pooled Σk, Σv, Σk⊙k (float32) and counts per cluster; per KV head."""
    per_head = rows * D * 2 * 2 + context * (rank + 4 + 1) + clusters * (3 * D + 1) * 4
    return batch * HKV * per_head


def run_config(pipe_for, state, query, density, dense_ms, dense_graph_ms, dense_bandwidth, batch, context, gqa):
    pipe: Pipeline = pipe_for(density)
    state = dataclasses.replace(state, pipeline=pipe, _plan=None)  # the plan depends on the budget
    rows = pipe.spec.budget.rows(context)

    # Correctness on this shape: flash against the reference, output poisoned first.
    explained = pipe.explain(query, state)
    selection, scores, inputs, quotas = explained.selection, explained.scores, explained.allocation, explained.quotas
    reference, _ = TorchKernel().attend(
        query.float(), state.keys.float(), state.values.float(), selection, state.pooled, state.scale
    )
    pipe.kernel.poison = True  # every buffer NaN first: the output must be fully written
    out, _ = pipe.kernel.attend(query, state.keys, state.values, selection, state.pooled, state.scale)
    pipe.kernel.poison = False
    out_full = pipe.attend(query, state)
    error = float((out.float() - reference).norm() / reference.norm())
    finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(out_full).all())

    plan = state.plan()
    grouped = oa.group_queries(query, HKV, pipe.spec.gqa == "shared")

    def score():  # the selector's scores as attend takes them: -inf outside the clusters
        return pipe.selector.score(grouped, state.index, state.keys, state.scale).masked_fill(
            plan.unclustered, -math.inf
        )

    def allocate():  # the cluster statistics, then the allocator
        mean_logit, logit_var = cluster_logit_stats(query, *state.cluster_moments(), state.scale)
        return pipe.allocator.allocate(dataclasses.replace(inputs, mean_logit=mean_logit, logit_var=logit_var))

    # The allocator's GPU path (ErrorGate: one Triton kernel) against its torch ops on the same device, and against
    # the CPU (float32 transcendentals may differ in the last bit between devices: rows whose quotas then differ).
    on_cpu = dataclasses.replace(
        inputs,
        **{
            f.name: getattr(inputs, f.name).cpu()
            for f in dataclasses.fields(inputs)
            if isinstance(getattr(inputs, f.name), torch.Tensor)
        },
    )
    same_allocation = (
        bool(torch.equal(WaterFillAllocator.allocate(pipe.allocator, inputs), quotas))
        if isinstance(pipe.allocator, WaterFillAllocator) and not pipe.allocator.reads_scores
        else None
    )  # None: no separate GPU path to compare (ErrorGate's floor runs its torch ops on every device)
    rows_off_cpu = int((pipe.allocator.allocate(on_cpu) != quotas.cpu()).any(-1).sum())
    # The GPU selection against the reference's sort-based one: the same rows.
    width = plan.max_selectable
    fast = select(scores, inputs.assignment, quotas, width=width, members=plan.members)
    slow = select_by_sorting(scores, inputs.assignment, quotas, width=width)
    same_selection = bool(torch.equal(fast.sort(-1).values, slow.sort(-1).values))
    times = {
        "scores_ms": bench(score),
        "allocation_ms": bench(allocate),
        "selection_ms": bench(lambda: select(scores, inputs.assignment, quotas, width=width, members=plan.members)),
        "selection_sort_ms": bench(lambda: select_by_sorting(scores, inputs.assignment, quotas, width=width)),
        "kernel_ms": bench(
            lambda: pipe.kernel.attend(query, state.keys, state.values, selection, state.pooled, state.scale)
        ),
        "attend_ms": bench(lambda: pipe.attend(query, state)),
    }
    # The same stages replayed from CUDA graphs: the GPU's own time, without Python's launch overhead.
    stages = {
        "scores": score,
        "allocation": allocate,
        "selection": lambda: select(scores, inputs.assignment, quotas, width=width, members=plan.members),
        "kernel": lambda: pipe.kernel.attend(query, state.keys, state.values, selection, state.pooled, state.scale),
        "attend": lambda: pipe.attend(query, state, validate=False),
    }
    state.plan()  # host-side facts, computed before capture
    graph_errors = {}
    for name, fn in stages.items():
        try:
            times[f"{name}_graph_ms"] = bench(graphed(fn))
        except Exception as exc:  # a stage that waits on the device cannot be captured: say which and why
            graph_errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()
    breakdown = kernel_breakdown(lambda: pipe.attend(query, state, validate=False))
    static = static_step(pipe, state, query)
    floor_bytes = sparse_bytes(batch, context, rows, state.num_clusters, 16)
    floor_ms = floor_bytes / dense_bandwidth * 1e3
    return {
        "batch": batch,
        "context": context,
        "density": density,
        "gqa": gqa,
        "rows": rows,
        "flash_vs_reference_rel_error": error,
        "finite": finite,
        "selection_matches_reference": same_selection,
        "allocation_matches_reference": same_allocation,
        "allocation_rows_differing_from_cpu": rows_off_cpu,
        **{k: round(v, 4) for k, v in times.items()},
        "dense_ms": round(dense_ms, 4),
        "dense_graph_ms": round(dense_graph_ms, 4),
        "speedup_attend": dense_ms / times["attend_ms"],
        "speedup_kernel_only": dense_ms / times["kernel_ms"],
        "speedup_kernel_graph": dense_graph_ms / times["kernel_graph_ms"] if "kernel_graph_ms" in times else None,
        "speedup_attend_graph": dense_graph_ms / times["attend_graph_ms"] if "attend_graph_ms" in times else None,
        "graph_errors": graph_errors,
        "floor_bytes": floor_bytes,
        "floor_ms": round(floor_ms, 4),
        "attend_over_floor": times["attend_ms"] / floor_ms,
        "kernel_note": pipe.kernel.note,
        "attend_kernels_ms": breakdown,
        **static,
        "speedup_static_step_graph": dense_graph_ms / static["static_step_graph_ms"],
    }


def rows_read(index) -> list[list[int]]:
    """Each selection row's positions read, in order (padding dropped)."""
    return [sorted(i for i in row if i >= 0) for row in index.reshape(-1, index.shape[-1]).tolist()]


def static_step(pipe: Pipeline, state, query) -> dict:
    """The fast decode path's step (``oa_core.static``: growth of one token + attend, on buffers at a capacity of
    N + 64): checked against the reference pipeline after the same append (rows read, output), then timed eagerly
    and in a CUDA graph. A timed step's growth repeats on the same token: its member count is restored each time."""
    static, (cache_k, cache_v), (new_k, new_v), restore = one_token_past(state)
    reference = state.fork()
    reference.append(new_k, new_v)
    expected = pipe.attend(query, reference).float()
    reference_rows = rows_read(pipe.explain(query, reference).selection.index)
    fused = static.fused
    if fused is not None:  # the kernel's fused step: its own selection (flash's buffers NaN first: all written)
        pipe.kernel.poison = True
        out, selection = fused.run(static, query, cache_k, cache_v)
        pipe.kernel.poison = False
        same_rows = rows_read(selection.index) == reference_rows
    else:
        out = static.step(query, cache_k, cache_v)
        same_rows = rows_read(static.selection(query, cache_k).index) == reference_rows
    out = out.float()

    def step():
        restore()
        return static.step(query, cache_k, cache_v)

    times = {"static_step_ms": bench(step), "static_step_graph_ms": bench(graphed(step))}
    breakdown = kernel_breakdown(step)
    if fused is not None:  # the composed step (each component in turn) on the same state, for comparison
        static.fused = None
        times["static_step_composed_graph_ms"] = bench(graphed(step))
        static.fused = fused
    if fused is not None and fused.shortlist_cuda:  # and the fused step with Triton's three shortlist launches
        fused.shortlist_cuda = False
        times["static_step_triton_shortlist_ms"] = bench(step)
        times["static_step_triton_shortlist_graph_ms"] = bench(graphed(step))
        fused.shortlist_cuda = True
    return {
        "static_step_fused": fused is not None,
        "static_step_shortlist": None if fused is None else "cuda" if fused.shortlist_cuda else fused.shortlist_note,
        "static_vs_reference_rel_error": float((out - expected).norm() / expected.norm()),
        "static_rows_match_reference": same_rows,
        **{k: round(v, 4) for k, v in times.items()},
        "static_step_kernels_ms": breakdown,
    }


def dense_times(query, keys, values) -> tuple[float, float]:
    """Dense SDPA decode over the whole cache: median milliseconds eagerly and replayed from a CUDA graph."""

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=True)

    return bench(dense), bench(graphed(dense))


def decode_growth(state, keys, values) -> tuple[float, float, float]:
    """A decode step's growth, outside attend: one token (a token leaving the local window joins its cluster) and the
    plan rebuilt; `append` concatenates the cache itself, `grow_to` follows a cache that grew by itself (the
    transformers integration: DynamicCache has concatenated already) → median milliseconds of append + plan, of
    grow_to + plan, and of the cache's own concatenation (keys and values)."""
    new_key, new_value = keys[:, :, -1:].clone(), values[:, :, -1:].clone()
    grown_keys, grown_values = torch.cat([keys, new_key], dim=2), torch.cat([values, new_value], dim=2)

    def grow(how):
        grown = state.fork()
        if how == "append":
            grown.append(new_key, new_value)
        else:
            grown.grow_to(grown_keys, grown_values)
        grown.plan()

    return (
        bench(lambda: grow("append")),
        bench(lambda: grow("grow_to")),
        bench(lambda: torch.cat([keys, new_key], dim=2)) * 2,
    )


def prepare_times(first: Pipeline, keys, values, prefill) -> tuple[float, float]:
    """The layer's dense causal prefill attention (batch 1) and ``first.prepare`` once more (warm): median
    milliseconds."""
    q_prefill = torch.randn(1, HQ, keys.shape[2], D, device=keys.device, dtype=torch.bfloat16)
    causal_ms = bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q_prefill, keys, values, is_causal=True, enable_gqa=True
        )
    )
    return causal_ms, bench(lambda: first.prepare(keys, values, prefill))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    results, prepare, growth = [], [], []
    for batch in args.batch:
        for context in args.context:
            keys, values, prefill, query = decode_inputs(batch, context, device)
            dense_ms, dense_graph_ms = dense_times(query, keys, values)
            dense_bytes = 2 * keys.numel() * keys.element_size()
            bandwidth = dense_bytes / (dense_ms * 1e-3)
            for gqa in args.gqa:
                base = {
                    "clusterer": {"name": "qgc", "num_clusters": args.clusters},
                    "kernel": "flash",
                    "gqa": gqa,
                    "budget": {"density": args.density[0]},
                }
                if args.spec is not None:
                    loaded = oa.load_spec(args.spec).model_dump(mode="json")
                    base.update(
                        {key: loaded[key] for key in ("selector", "allocator", "tail", "proxy", "sink", "local")}
                    )
                first = oa.build(base)
                torch.cuda.synchronize()
                start = time.perf_counter()
                state = first.prepare(keys, values, prefill)
                torch.cuda.synchronize()
                prepare_ms = (time.perf_counter() - start) * 1e3

                def pipe_for(density, first=first, base=base):
                    spec = first.spec.model_copy(update={"budget": oa.Budget(density=density)})
                    return Pipeline(
                        spec, first.clusterer, first.selector, first.allocator, first.kernel, first.kernel_note
                    )

                for density in args.density:
                    row = run_config(
                        pipe_for, state, query, density, dense_ms, dense_graph_ms, bandwidth, batch, context, gqa
                    )
                    row.update(dense_bandwidth_TBps=round(bandwidth / 1e12, 3))
                    results.append(row)
                    graph = {k[:-9]: v for k, v in row.items() if k.endswith("_graph_ms")}
                    print(
                        f"B={batch:>2} N={context:>6} {gqa:8s} {density:>5.0%}: dense {dense_ms:.3f} ms; eager "
                        f"attend {row['attend_ms']:.3f} ms; in CUDA graphs "
                        + ", ".join(f"{k} {v:.3f}" for k, v in graph.items())
                        + f"; floor {row['floor_ms']:.3f} ms; err {row['flash_vs_reference_rel_error']:.1e}"
                        + f"; selection = reference: {row['selection_matches_reference']}, allocation = "
                        f"reference: {row['allocation_matches_reference']} "
                        f"({row['allocation_rows_differing_from_cpu']} rows differ from the CPU's)"
                        + (f"; not captured: {row['graph_errors']}" if row["graph_errors"] else "")
                        + f"; static step (grow + attend{', fused' if row['static_step_fused'] else ''}) "
                        f"{row['static_step_graph_ms']:.3f} ms in a graph "
                        f"({row['speedup_static_step_graph']:.2f}× dense), = reference rows: "
                        f"{row['static_rows_match_reference']}, err {row['static_vs_reference_rel_error']:.1e}",
                        flush=True,
                    )
                append_ms, grow_to_ms, concat_ms = decode_growth(state, keys, values)
                growth.append(
                    {
                        "batch": batch,
                        "context": context,
                        "gqa": gqa,
                        "append_and_plan_ms": round(append_ms, 4),
                        "grow_to_and_plan_ms": round(grow_to_ms, 4),
                        "dense_ms": round(dense_ms, 4),
                        "cache_concat_ms": round(concat_ms, 4),
                    }
                )
                print(f"decode growth: {growth[-1]}", flush=True)
                if batch == 1 and gqa == args.gqa[0]:
                    causal_ms, again_ms = prepare_times(first, keys, values, prefill)
                    prepare.append(
                        {
                            "context": context,
                            "prepare_ms_first_call": round(prepare_ms, 3),
                            "prepare_ms": round(again_ms, 3),
                            "dense_prefill_attention_ms": round(causal_ms, 3),
                        }
                    )
                    print(f"prepare at N={context}: {prepare[-1]}", flush=True)
                del state
            del keys, values
            torch.cuda.empty_cache()
            write(args, results, prepare, growth)
    print(f"wrote {args.out}")
    return 0


def sm_clock() -> str:
    """The SM clock now and its maximum, from nvidia-smi (latency-bound kernels scale with it, dense decode does
    not)."""
    import subprocess

    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write(args, results, prepare, growth) -> None:
    """The record so far (written after every batch × context, so that a run cut short keeps what it measured)."""
    import triton

    record = {
        "benchmark": "kernel_h200",
        "shapes": {"query_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16", "decode_queries": 1},
        "data": "random bf16 keys/values/prefill queries (seed 0); each query is 1.5× one of its KV head's keys",
        "clusters": args.clusters,
        "spec": str(args.spec) if args.spec is not None else None,
        "results": results,
        "prepare": prepare,
        "decode_growth": growth,
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "python": platform.python_version(),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "sm_clock": sm_clock(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "openattention": oa.__version__,
        },
        "provenance": provenance("cuda"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
