"""Attention error on a real model's caches: OpenAttention against oracle top-k.

The protocol is ``oa_core.analysis.attention_error``'s: N context tokens of the essay haystack, the model's own queries
at the P positions after them as decode queries over the N-token prefix, relative output error against dense per
(layer, query head, query). Writes benchmarks/results/attention_error.json and prints the table.

    python benchmarks/attention_error.py                        # SmolLM2-135M (offline), 4096 tokens, 64 queries
    python benchmarks/attention_error.py --model meta-llama/Llama-3.1-8B --layers 4 16 28
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import oa_core as oa
from oa_core.analysis.attention_error import PREFILL_QUERIES, format_table, measure
from oa_core.analysis.offline_model import MODEL_HELP, TEXTS
from oa_core.analysis.provenance import provenance

# One sink and local window for every method: at 1% of 4096 tokens the budget is 40 rows, fewer than the default
# sink + local of 4 + 64 = 68, so the default could not run there.
SINK, LOCAL = 4, 16
# The default pipeline (specs/openattention.yaml), from the components' and the spec's own defaults: PQS's codes of
# every dimension, its shortlist re-scored from its keys, ErrorGate's floor, second-order proxies. The paper's
# (specs/openattention-paper.yaml): QGS's rank-16 codes in the query basis, and none of the other three.
DEFAULT = {"clusterer": "qgc", "selector": "pq", "allocator": "errorgate", "tail": "proxy"}
PAPER = {
    "clusterer": "qgc",
    "selector": {"name": "qgs", "params": {"rerank": 0.0, "key_rank": 0}},
    "allocator": {"name": "errorgate", "params": {"floor": 0.0}},
    "tail": "proxy",
    "proxy": "mean",
}
METHODS = {
    "openattention": {**DEFAULT, "gqa": "per_head"},
    # The same with one selection per GQA group, as the fast path's speed figures run it.
    "openattention-shared": {**DEFAULT, "gqa": "shared"},
    "openattention-paper": {**PAPER, "gqa": "per_head"},
    "openattention-paper-shared": {**PAPER, "gqa": "shared"},
    # The default with QGS's int8 codes of a rank-16 projection in PQS's place (specs/ablate-selector-qgs.yaml, the
    # default until issue 54), and with QGS's basis from the query geometry alone (``key_rank`` 0, the paper's).
    "openattention-qgs": {**DEFAULT, "selector": "qgs", "gqa": "per_head"},
    "openattention-query-basis": {**DEFAULT, "selector": {"name": "qgs", "params": {"key_rank": 0}}, "gqa": "per_head"},
    # The selector isolated: the default with exact logits (the oracle selector) instead of PQS.
    "openattention-oracle-selection": {**DEFAULT, "selector": "oracle", "gqa": "per_head"},
    "oracle-topk": {"selector": "oracle", "allocator": "global", "tail": "discard", "gqa": "per_head"},
    # The allocator isolated: global top scores instead of ErrorGate, with PQS and with the oracle selector.
    "openattention-global-allocation": {**DEFAULT, "allocator": "global", "gqa": "per_head"},
    "oracle-topk-proxy": {"selector": "oracle", "allocator": "global", "tail": "proxy", "gqa": "per_head"},
    # The proxy isolated: the default with the paper's mean proxies, and oracle top-k with them.
    "openattention-mean-proxy": {**DEFAULT, "proxy": "mean", "gqa": "per_head"},
    "oracle-topk-mean-proxy": {
        "selector": "oracle",
        "allocator": "global",
        "tail": "proxy",
        "proxy": "mean",
        "gqa": "per_head",
    },
}
# The accuracy issue's targets: mean error at most this fraction of oracle top-k's, at these densities.
TARGETS = {0.01: 0.4, 0.03: 0.4}
CANDIDATES = ("openattention", "openattention-shared", "openattention-qgs")  # the methods held against the targets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--tokens", type=int, default=4096, help="N: context tokens in the cache")
    parser.add_argument("--decode", type=int, default=64, help="P: decode queries, the tokens after the context")
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=None,
        help="layer indices (default: 6 spread over the depth, first and last included)",
    )
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.05, 0.03, 0.01])
    parser.add_argument("--seed", type=int, default=0, help="the pipelines' seed (k-means initialisation)")
    parser.add_argument(
        "--text", choices=TEXTS, default="essays", help="the haystack the context is cut from (default: %(default)s)"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(METHODS),
        default=list(METHODS),
        help="the methods to run (default: all; oracle-topk is always run, the ratios' base)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: benchmarks/results/attention_error.json, attention_error_TEXT.json for another text",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        suffix = "" if args.text == "essays" else f"_{args.text.replace('-', '_')}"
        args.out = Path(f"benchmarks/results/attention_error{suffix}.json")
    if args.tokens < max(PREFILL_QUERIES, SINK + LOCAL + 1) or args.decode < 1:
        parser.error(f"--tokens must be at least {PREFILL_QUERIES} and --decode at least 1")
    return args


def run(args: argparse.Namespace) -> dict:
    wanted = dict.fromkeys([*args.methods, "oracle-topk"])
    methods = {name: {**METHODS[name], "sink": SINK, "local": LOCAL} for name in wanted}
    result = measure(
        methods,
        args.densities,
        model=args.model,
        tokens=args.tokens,
        decode=args.decode,
        layers=args.layers,
        seed=args.seed,
        text=args.text,
    )
    result.update(
        sink=SINK,
        local=LOCAL,
        provenance=provenance("cpu"),
        note=(
            f"sink={SINK}, local={LOCAL} for every method: {min(args.densities):.0%} of {args.tokens} tokens is "
            f"{oa.Budget(density=min(args.densities)).rows(args.tokens)} rows, and the default sink + local is 68. "
            "Decode queries are the model's queries at the positions after the context, each attending the N-token "
            "prefix only. Errors are relative output errors per (layer, query head, query)."
        ),
    )
    result["ratios_to_oracle_topk"] = {
        method: ratios(result["results"], args.densities, method) for method in CANDIDATES if method in methods
    }
    return result


def ratios(results: dict, densities: list[float], method: str) -> dict:
    """Mean error of ``method`` over oracle top-k per density, per layer too, against the targets."""
    out = {}
    for density in densities:
        ours, theirs = results[str(density)][method], results[str(density)]["oracle-topk"]
        ratio = ours["mean_error"] / theirs["mean_error"]
        entry = {
            "ratio": ratio,
            "per_layer": {
                layer: ours["per_layer_mean_error"][layer] / theirs["per_layer_mean_error"][layer]
                for layer in ours["per_layer_mean_error"]
            },
        }
        target = next((t for d, t in TARGETS.items() if math.isclose(d, density)), None)
        if target is not None:
            entry.update(target=target, met=ratio <= target)
        out[str(density)] = entry
    return out


def print_table(result: dict) -> None:
    print()
    print(format_table(result))
    for method, entries in result["ratios_to_oracle_topk"].items():
        for density, entry in entries.items():
            target = (
                f"  target ≤ {entry['target']}: {'met' if entry['met'] else 'NOT met'}" if "target" in entry else ""
            )
            per_layer = " ".join(f"L{layer}:{r:.2f}" for layer, r in entry["per_layer"].items())
            print(f"{method} / oracle-topk at {float(density):.0%}: {entry['ratio']:.3f}{target}   [{per_layer}]")
    print(f"time: {result['timings']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
