"""Every spec in specs/ on a real model's caches: baselines and ablations (paper Tables 1–4).

The protocol is the attention-error benchmark's (``oa_core.analysis.attention_error``): N context tokens of the essay
haystack, the model's own queries at the P positions after them as decode queries, scored against dense float32
attention. Per spec and density: relative output error (mean, p90), measured read density, weight discrepancy E, the
selector's top-32 logit recall within its E_sel best scores, and the Spearman of ErrorGate's ε̂_b against the true
per-cluster discrepancy (and against the full-covariance estimate). Writes benchmarks/results/ablations.json and
prints Markdown tables grouped like the paper's.

    python benchmarks/ablations.py                      # SmolLM2-135M (offline), 4096 tokens, 64 queries
    python benchmarks/ablations.py --specs specs/openattention.yaml specs/quest.yaml --layers 0 12
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from oa_core.analysis.attention_error import measure
from oa_core.analysis.offline_model import MODEL_HELP
from oa_core.analysis.provenance import provenance

SPECS = Path(__file__).resolve().parent.parent / "specs"
# The same sink and local window for every spec: 1% of 4096 tokens is 40 rows, below the specs' 4 + 64.
SINK, LOCAL = 4, 16
GROUPS = {
    "Methods (paper §4.1)": [
        "dense",
        "oracle-topk",
        "quest",
        "magicpig",
        "vattention",
        "retroinfer",
        "openattention",
        "openattention-paper",
    ],
    "Table 1: clusterer": ["openattention", "ablate-clusterer-kmeans", "ablate-clusterer-position"],
    "Table 2: selector": [
        "openattention",
        "ablate-selector-query-basis",
        "ablate-selector-oracle",
        "ablate-selector-lsh",
    ],
    "Table 3: ErrorGate ranking (and uniform, Table 4)": [
        "openattention",
        "ablate-allocator-mass",
        "ablate-allocator-variance",
        "ablate-allocator-uniform",
    ],
    "Tail (Eq. 2, Table 4)": ["openattention", "ablate-tail-mean-proxy", "ablate-tail-discard", "ablate-tail-sample"],
}


def load_methods(paths: list[Path]) -> dict[str, dict]:
    """Spec name → spec mapping, with this benchmark's sink/local; the budget is dropped (set per density) except
    where it covers the whole context (dense)."""
    methods = {}
    for path in paths:
        spec = yaml.safe_load(path.read_text()) or {}
        budget = spec.pop("budget", None)
        spec.update(sink=SINK, local=LOCAL)
        if budget is not None and budget.get("density") == 1.0:
            spec["budget"] = budget
        methods[path.stem] = spec
    return methods


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", type=Path, nargs="+", default=sorted(SPECS.glob("*.yaml")))
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--layers", type=int, nargs="+", default=None)
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.05, 0.03, 0.01])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ablations.json"))
    return parser.parse_args(argv)


def markdown(result: dict) -> str:
    """One table per group: mean error per density, then p90, E and recall at the lowest and Spearman."""
    densities = [str(d) for d in result["densities"]]
    low = densities[-1]
    table = result["results"]
    lines = []

    def cell(method, density, key, fmt="{:.3f}"):
        value = table[density][method].get(key)
        return fmt.format(value) if value is not None else "–"

    for title, members in GROUPS.items():
        members = [m for m in members if m in table[low]]
        if not members:
            continue
        lines += [
            f"**{title}**",
            "",
            "| spec | "
            + " | ".join(f"error {float(d):.0%}" for d in densities)
            + f" | p90 {float(low):.0%} | E {float(low):.0%} | ρ {float(low):.0%} | top-32 recall "
            + " / ".join(f"{float(d):.0%}" for d in densities[-3::2])
            + " | ErrorGate Spearman |",
            "|---" * (len(densities) + 6) + "|",
        ]
        for m in members:
            recall = " / ".join(cell(m, d, "top32_recall", "{:.2f}") for d in densities[-3::2])
            lines.append(
                f"| {m} | "
                + " | ".join(cell(m, d, "mean_error") for d in densities)
                + f" | {cell(m, low, 'p90_error')} | {cell(m, low, 'weight_discrepancy')}"
                + f" | {cell(m, low, 'measured_density', '{:.4f}')} | {recall}"
                + f" | {cell(m, low, 'errorgate_spearman', '{:.2f}')} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    methods = load_methods(args.specs)
    result = measure(
        methods,
        args.densities,
        model=args.model,
        tokens=args.tokens,
        decode=args.decode,
        layers=args.layers,
        seed=args.seed,
        diagnostics=True,
    )
    result.update(
        benchmark="ablations",
        sink=SINK,
        local=LOCAL,
        provenance=provenance("cpu"),
        note=(
            f"Every spec of specs/ with sink={SINK}, local={LOCAL} and the budget set per density (dense keeps its "
            "whole-context budget). E: weight discrepancy (docs/design.md §1). top32_recall: share of the true top-32 "
            "logits of the clusterable region within the selector's E_sel best scores. errorgate_spearman: ErrorGate's "
            "ε̂_b (diagonal variance, no reads) against the true per-cluster proxy discrepancy; _full_variance: against "
            "the same estimate with the logits' exact within-cluster variance."
        ),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    print(f"time: {result['timings']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
