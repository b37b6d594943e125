"""Which launches suit the default's shortlist on the GPU (``TwoStage.pq_shortlist``: ``pq_scores``, ``pq_cut``,
``pq_list``): positions per score program, the cut's block, the listing's block, and each one's warps?

At the Llama-3.1-8B shape (8 KV heads of 4 query heads, head dim 128) per head at 1%, with the default spec, at
16 × 16K (many programs) and 2 × 128K (few (batch row, KV head) pairs, long rows): one knob at a time from the
defaults, each launch's GPU time (torch.profiler) and the whole fused step's in a CUDA graph. Every setting's rows
are checked against the defaults'.

    python benchmarks/studies/shortlist_launch_sweep.py     # on the GPU: results/shortlist_launch_sweep_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import oa_core as oa  # noqa: E402
from kernel_h200 import bench, decode_inputs, graphed, kernel_breakdown, one_token_past  # noqa: E402
from oa_core.analysis.provenance import provenance  # noqa: E402
from oa_plugins.kernels import two_stage  # noqa: E402
from oa_plugins.selectors import pq  # noqa: E402

KNOBS = {
    "SCORE_CHUNK": [512, 1024, 2048],
    "SCORE_WARPS": [1, 2, 4, 8],
    "LUT_CODES": [16, 32, 64, 128],
    "RADIX_BLOCK": [256, 512, 1024, 2048],
    "CUT_WARPS": [4, 8, 16],
    "PQ_SEGMENT": [512, 1024, 2048, 4096],
    "PQ_LIST_BLOCK": [32, 64, 128, 256],
    "LIST_GATHER": [8, 16, 32],
    "LIST_WARPS": [2, 4, 8],
}
KERNELS = ("pq_scores", "pq_cut", "pq_list", "refine")


def module(knob: str):
    """Where a knob lives: PQS's score block in the selector, the rest in ``two_stage``."""
    return pq if knob == "LUT_CODES" else two_stage


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["16x16384", "2x131072"])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this study needs a CUDA device", file=sys.stderr)
        return 2
    spec = oa.load_spec(ROOT / "specs" / "openattention.yaml").model_dump(mode="json")
    spec.update(gqa="per_head", budget={"density": args.density})
    pipe = oa.build(spec)
    defaults = {name: getattr(module(name), name) for name in KNOBS}
    runs = []
    for shape in args.shapes:
        batch, context = (int(x) for x in shape.split("x"))
        keys, values, prefill, query = decode_inputs(batch, context, torch.device("cuda"))
        static, cache, _, restore = one_token_past(pipe.prepare(keys, values, prefill))

        def step(static=static, cache=cache, restore=restore, query=query):
            restore()
            return static.fused.run(static, query, *cache)

        expected = step()[1].index.clone()
        settings = [{}] + [{k: v} for k, values in KNOBS.items() for v in values if v != defaults[k]]
        for setting in settings:
            for name, value in {**defaults, **setting}.items():
                setattr(module(name), name, value)
            same = torch.equal(step()[1].index, expected)
            kernels = kernel_breakdown(step)
            row = {
                "batch": batch,
                "context": context,
                "setting": setting or "defaults",
                "same_rows": same,
                "step_graph_ms": round(bench(graphed(step)), 4),
                **{f"{k}_ms": kernels.get(k) for k in KERNELS},
            }
            runs.append(row)
            print(row, flush=True)
        for name, value in defaults.items():
            setattr(module(name), name, value)
        del static, cache, keys, values
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name().split()[1].lower()
    out = args.out or ROOT / "benchmarks" / "studies" / "results" / f"shortlist_launch_sweep_{gpu}.json"
    out.write_text(
        json.dumps(
            {"what": __doc__.split("\n\n")[0], "defaults": defaults, "runs": runs, "provenance": provenance("cuda")},
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
