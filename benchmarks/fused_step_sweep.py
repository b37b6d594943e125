"""The fused static step against the reference pipeline over random configurations: does it read the same rows and
give the same output beyond the shapes its tests pin?

Each configuration draws, from its own seed, a spec and a cache: the default's components (QGC, PQS or QGS, ErrorGate)
with a re-rank of 0, 2 or 4 × the budget and a floor of 0 or 0.5, PQS's sub-spaces of 1, 2 or 4 dimensions and codes of
4 or 8 bits, QGS's rank 4, 8 or 16 with 0, 2 or half of it along the keys, 3 to 33 clusters, a budget by density
(5–40%) or by tokens, sink 0–4 and local window 0–16, both tails and both proxies, GQA per head or shared with groups
of 1, 2, 3, 4 or 8 query heads, head dims of 16 to 128 (80 and 96 included), float32, bfloat16 or float16, 60–260
tokens with a left-padded batch row, 2–5 decode steps, and 0–9 spare slots. It decodes them through the reference
pipeline, the composed static step and the fused one (``oa_core.testing.fused.decode_side_by_side``) and records, per
configuration, the steps whose rows differ from the reference's, the largest relative output error, and whether the
fused index and runs were the composed step's at every step. A configuration a static state cannot serve (the budget
covers a row: it is read dense), or whose step the kernel composes instead of fusing, is counted apart.

On the CPU the kernels run under Triton's interpreter (set here); on a GPU they run compiled, with the CUDA shortlist
where the GPU has one. There sums run in another order than on the CPU, so a key within rounding of a tie may go the
other way (``oa_plugins.kernels.flash_step``): rows that differ are recorded, not hidden.

    python benchmarks/fused_step_sweep.py                       # 200 configurations on the CPU (interpreter)
    python benchmarks/fused_step_sweep.py --device cuda --out benchmarks/results/fused_step_sweep_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "fused_step_sweep.json"
# Relative output error allowed per dtype: float32's as the tests hold it, half precisions' by their rounding.
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 2e-3}


def draw(seed: int) -> dict:
    """One configuration: a spec and the inputs' shape (``decode_side_by_side``'s keyword arguments)."""
    r = random.Random(seed)
    sink, local = r.choice([0, 1, 4]), r.choice([0, 1, 5, 16])
    rerank = r.choice([0, 2, 4, 4])
    budget = r.choice([{"density": d} for d in (0.05, 0.1, 0.2, 0.4)] + [{"tokens": sink + local + r.randint(1, 40)}])
    spec = {
        "clusterer": {"name": "qgc", "num_clusters": r.choice([3, 8, 13, 16, 24, 33])},
        "selector": r.choice(
            [
                {"name": "pq", "rerank": rerank, "dims": r.choice([1, 2, 2, 4]), "bits": r.choice([4, 4, 8])},
                {"name": "pq", "rerank": rerank},
                {"name": "qgs", "rerank": rerank, "rank": r.choice([4, 8, 16]), "key_rank": r.choice([None, 0, 2])},
            ]
        ),
        "allocator": {"name": "errorgate", "floor": r.choice([0, 0.5, 0.5]) if rerank else 0},
        "sink": sink,
        "local": local,
        "budget": budget,
        "kernel": "flash",
        "gqa": r.choice(["per_head", "shared"]),
        "tail": r.choice(["proxy", "proxy", "discard"]),
        "proxy": r.choice(["second-order", "mean"]),
    }
    inputs = {
        "group": r.choice([1, 2, 3, 4, 8]),
        "dim": r.choice([16, 32, 64, 80, 96, 128]),
        "tokens": r.randint(60, 260),
        "steps": r.randint(2, 5),
        "room": r.choice([0, 0, 3, 9]),
        "dtype": r.choice(["float32", "float32", "bfloat16", "float16"]),
        "seed": seed,
    }
    return {"spec": spec, "inputs": inputs}


def run_one(config: dict, device: str) -> dict:
    import torch

    from oa_core.static import StaticUnsupported
    from oa_core.testing.fused import decode_side_by_side

    inputs = {**config["inputs"], "dtype": getattr(torch, config["inputs"]["dtype"]), "device": device}
    start = time.perf_counter()
    try:
        records, _, _ = decode_side_by_side(config["spec"], **inputs)
    except StaticUnsupported as error:
        return {"outcome": "dense", "why": str(error)}
    except ValueError as error:  # the kernel composes this spec's step: nothing fused to compare
        if not str(error).startswith("no fused step"):
            raise
        return {"outcome": "not fused", "why": str(error)}
    differing = [step for step, r in enumerate(records) if r.rows != r.reference_rows]
    error = max(
        float((r.out.double() - r.reference_out.double()).norm() / r.reference_out.double().norm()) for r in records
    )
    agrees = not differing and error < TOLERANCE[config["inputs"]["dtype"]]
    return {
        "outcome": "same" if agrees and all(r.same_layout for r in records) else "differs",
        "steps_with_other_rows": differing,
        "relative_error": error,
        "same_layout_as_composed": all(r.same_layout and not r.weighted for r in records),
        "seconds": round(time.perf_counter() - start, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=int, default=200, help="how many random configurations")
    parser.add_argument("--seed", type=int, default=0, help="configuration i draws from seed + i")
    parser.add_argument("--device", default="cpu", help="cpu (Triton's interpreter) or cuda")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.configs < 1:
        parser.error("--configs: at least 1")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
    import torch
    from tqdm import tqdm

    import oa_core as oa
    from oa_core.analysis.provenance import provenance
    from oa_plugins.allocators import errorgate

    if "flash" not in oa.available()["kernel"]:
        parser.error("the flash kernel is not available here (Triton)")
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device")
    # On the CPU the reference allocates with ErrorGate's Triton kernel too, as the tests do: row for row the same
    # arithmetic (the torch ops' rounding could move a quota at a tie).
    errorgate.INTERPRET_ON_CPU = args.device == "cpu"
    results, start = [], time.perf_counter()
    for i in tqdm(range(args.configs), desc="configurations", unit="config"):
        config = draw(args.seed + i)
        results.append({**config, **run_one(config, args.device)})
    outcomes = Counter(r["outcome"] for r in results)
    worst: dict[str, float] = {}
    for r in results:
        if r["outcome"] != "dense":
            dtype = r["inputs"]["dtype"]
            worst[dtype] = max(worst.get(dtype, 0.0), r["relative_error"])
    summary = {
        "configurations": len(results),
        "outcomes": dict(outcomes),
        "worst_relative_error": worst,
        "tolerance": TOLERANCE,
        "all_same": outcomes["differs"] == 0,
    }
    report = {
        "benchmark": "fused_step_sweep",
        "what": __doc__.split("\n\n")[0],
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "triton_interpreter": args.device == "cpu",
        "summary": summary,
        "seconds": round(time.perf_counter() - start, 1),
        "provenance": provenance(args.device),
        "configs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    for r in results:
        if r["outcome"] == "differs":
            print(
                "differs:", json.dumps({k: r[k] for k in ("spec", "inputs", "steps_with_other_rows", "relative_error")})
            )
    print(f"wrote {args.out}")
    return 0 if summary["all_same"] else 1


if __name__ == "__main__":
    sys.exit(main())
