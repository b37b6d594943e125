"""The fused step's CUDA shortlist (``oa_plugins/kernels/pq_shortlist.cu``) against the three Triton launches it
replaces (``pq_scores``, ``pq_cut``, ``pq_list``), on the same inputs at the Llama-3.1-8B shape, and its phases timed
apart (GPU only, sm_90+).

Inputs: random tables and 4-bit codes of 64 sub-spaces (head dim 128), keys and queries (bf16), clusters of random
positions (the sink and the local window outside), per head (4 selection rows a KV head) and shared, the default's
rerank 4 at 1% and 3%. Checks, at that scale: both ways give the same lengths, cuts, ties and listed positions, exact
logits and scores within float rounding (the sums run in another order), the same boxes. Timed (median ms, eagerly and
replayed from a CUDA graph): the three launches; the kernel whole; the kernel stopped after the scores, after the cut,
and after the listing without the exact logits (its ``stop`` knob) — each phase's cost is the difference.
Writes ``benchmarks/studies/results/pq_shortlist_phases_<gpu>.json``.

    python benchmarks/studies/pq_shortlist_phases.py
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

HKV, HQ, D, M, CC, C = 8, 32, 128, 64, 16, 64
SINK, LOCAL, RERANK, FLOOR = 4, 64, 4.0, 0.5
STOPS = {"scores": 1, "scores_and_cut": 2, "all_but_exact_logits": 3, "whole": 0}


def inputs(batch: int, context: int, device: torch.device):
    """A state-like namespace with the index, clusters and bookkeeping the launches read, the keys, the query."""
    gen = torch.Generator(device=device).manual_seed(0)
    n = context
    codes = torch.randint(0, 256, (batch, HKV, n, M // 2), dtype=torch.uint8, device=device, generator=gen)
    assignment = torch.randint(0, C, (batch, HKV, n), device=device, generator=gen)
    assignment[:, :, :SINK] = C
    assignment[:, :, n - LOCAL :] = C
    index = SimpleNamespace(codes=codes, centroids=torch.empty(batch, HKV, M, CC, D // M, device=device))
    state = SimpleNamespace(
        index=index,
        assignment=assignment,
        num_clusters=C,
        length=torch.tensor([n], device=device),
        start=torch.zeros(batch, dtype=torch.long, device=device),
        capacity=n,
        scale=D**-0.5,
        pipeline=SimpleNamespace(spec=SimpleNamespace(local=LOCAL)),
    )
    keys = torch.randn(batch, HKV, n, D, device=device, generator=gen).to(torch.bfloat16)
    query = torch.randn(batch, HQ, 1, D, device=device, generator=gen).to(torch.bfloat16)
    return state, keys, query


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["16x16384", "32x32768", "2x131072"])
    parser.add_argument("--density", type=float, nargs="+", default=[0.01, 0.03])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("needs a CUDA GPU of sm_90 or later", file=sys.stderr)
        return 1
    import triton.testing

    from oa_core.analysis.provenance import provenance
    from oa_plugins.kernels import pq_shortlist_cuda
    from oa_plugins.kernels.two_stage import TwoStage

    def timed(fn) -> dict[str, float]:
        return {
            "eager_ms": round(triton.testing.do_bench(fn, return_mode="median"), 4),
            "graph_ms": round(triton.testing.do_bench_cudagraph(fn, return_mode="median"), 4),
        }

    device = torch.device("cuda")
    runs = []
    for shape in args.shapes:
        batch, context = (int(v) for v in shape.split("x"))
        state, keys, query = inputs(batch, context, device)
        reason = pq_shortlist_cuda.unavailable_reason(state)
        if reason is not None:
            print(f"{shape}: {reason}", file=sys.stderr)
            return 1
        for gqa in ("per_head", "shared"):
            Gs, G = (HQ // HKV, 1) if gqa == "per_head" else (1, HQ // HKV)
            for density in args.density:
                tables = torch.randn(batch, HKV, HQ // HKV, M, CC, device=device)
                width = SINK + LOCAL + context
                two_stage = TwoStage(RERANK, FLOOR, width, context, device)
                budget = (state.length, state.start, torch.tensor(density, dtype=torch.float64, device=device))
                budget_args = (*budget, SINK + LOCAL, -1)
                rows = batch * HKV * Gs
                three_scores = torch.empty(rows, context, device=device)
                one_scores = torch.empty_like(three_scores)

                rest = (keys, query, budget_args, Gs, G)
                three = functools.partial(two_stage.pq_shortlist, tables, state, three_scores, *rest)
                one = functools.partial(pq_shortlist_cuda.launch, two_stage, state, tables, one_scores, *rest)

                expected, got = three(), one()
                torch.cuda.synchronize()
                boxed = one_scores.isnan()
                same = {
                    "counts_cut_ties": all(
                        torch.equal(getattr(got, f), getattr(expected, f)) for f in ("counts", "cut", "ties")
                    ),
                    "boxes": torch.equal(boxed, three_scores.isnan())
                    and torch.equal(one_scores[boxed].view(torch.int32), three_scores[boxed].view(torch.int32)),
                    "scores_max_diff": float((one_scores[~boxed] - three_scores[~boxed]).abs().max()),
                }
                listed_same, exact_diff = True, 0.0
                for row, count in enumerate(got.counts.tolist()):
                    listed_same &= torch.equal(got.listed[row, :count], expected.listed[row, :count])
                    diff = (got.exact[row, :count] - expected.exact[row, :count]).abs().max() if count else 0
                    exact_diff = max(exact_diff, float(diff))
                same.update(listed=listed_same, exact_max_diff=exact_diff, mean_length=float(got.counts.float().mean()))
                record = {"batch": batch, "context": context, "gqa": gqa, "density": density, "checks": same}
                record["triton_three_launches"] = timed(three)
                for name, stop in STOPS.items():
                    record[f"cuda_{name}"] = timed(lambda stop=stop, one=one: one(stop))
                runs.append(record)
                print(
                    f"{batch:>2} × {context:>6} {gqa:8s} {density:.0%}: {same}; graphed ms — Triton "
                    f"{record['triton_three_launches']['graph_ms']:.3f}; CUDA "
                    + ", ".join(f"{name} {record[f'cuda_{name}']['graph_ms']:.3f}" for name in STOPS),
                    flush=True,
                )
    gpu = torch.cuda.get_device_name().split()[1].lower()
    out = args.out or Path(__file__).parent / "results" / f"pq_shortlist_phases_{gpu}.json"
    record = {"what": __doc__.split("\n\n")[0], "runs": runs, "provenance": provenance("cuda")}
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
