"""The two-stage selection's parameters swept on the attention-error protocol: QGS's ``rerank`` (the shortlist, in
multiples of the selectable budget, re-scored from the keys) × ErrorGate's ``floor`` (the share of the budget read
first as the best-scored rows), against the paper's pipeline, the oracle selector and oracle top-k, per text.

    python benchmarks/studies/two_stage_grid.py --text essays  # → benchmarks/studies/results/two_stage_grid_essays.json
    python benchmarks/studies/two_stage_grid.py --text python-docs

Same protocol and settings as ``benchmarks/attention_error.py`` (SmolLM2-135M, 4,096 tokens, 64 decode queries, six
layers, sink 4 and local 16, ``gqa: per_head``); prints mean error and its ratio to oracle top-k per method.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from oa_core.analysis.attention_error import measure
from oa_core.analysis.offline_model import TEXTS

BASE = {"clusterer": "qgc", "tail": "proxy", "gqa": "per_head", "sink": 4, "local": 16}
RERANKS = (0, 2, 4, 8)
FLOORS = (0.0, 0.5, 0.75, 1.0)


def method(rerank: float, floor: float, selector: str = "qgs") -> dict:
    chosen = {"name": "qgs", "params": {"rerank": rerank}} if selector == "qgs" else selector
    return {**BASE, "selector": chosen, "allocator": {"name": "errorgate", "params": {"floor": floor}}}


METHODS = {
    **{f"rerank {r:g}, floor {f:g}": method(r, f) for r in RERANKS for f in FLOORS},
    "oracle selector, floor 0": method(0, 0.0, "oracle"),
    "oracle selector, floor 0.5": method(0, 0.5, "oracle"),
    "oracle top-k + proxies": {**BASE, "selector": "oracle", "allocator": "global"},
    "oracle top-k": {**BASE, "selector": "oracle", "allocator": "global", "tail": "discard"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", choices=TEXTS, default="essays", help="default: %(default)s")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.03, 0.01])
    parser.add_argument(
        "--out", type=Path, default=None, help="default: benchmarks/studies/results/two_stage_grid_TEXT.json"
    )
    args = parser.parse_args(argv)
    out = args.out or Path(f"benchmarks/studies/results/two_stage_grid_{args.text.replace('-', '_')}.json")
    result = measure(METHODS, args.densities, text=args.text)
    result["ratios_to_oracle_topk"] = {
        str(d): {
            name: row["mean_error"] / result["results"][str(d)]["oracle top-k"]["mean_error"]
            for name, row in result["results"][str(d)].items()
        }
        for d in args.densities
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    width = max(map(len, METHODS))
    print(f"{'method':{width}s} " + " ".join(f"{f'{d:.0%} error / ratio':>20s}" for d in args.densities))
    for name in METHODS:
        cells = [
            f"{result['results'][str(d)][name]['mean_error']:.3f} / {result['ratios_to_oracle_topk'][str(d)][name]:.2f}"
            for d in args.densities
        ]
        print(f"{name:{width}s} " + " ".join(f"{c:>20s}" for c in cells))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
