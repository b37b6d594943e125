"""Does QGS's query subspace hold what a needle's answer looks for? The answer's log-likelihood with QGS at ranks 16,
64 and the head dim (no re-rank: the codes' scores alone) against oracle selection and dense, on RULER's niah_single_2.

    python benchmarks/studies/selector_rank.py --model gemma3-270m --samples 4
                                                          # → benchmarks/studies/results/selector_rank_<model>.json

Each sample's context is prefilled once; every spec answers from its own copy of the cache (setup B, 5% read, the
default pipeline but for the selector). On Gemma-3-270M the subspace of the last 256 context queries misses the
needle up to rank 64 (the answer's log-likelihood falls by 13-21 nats); at the full rank QGS equals the oracle.
The default (``key_rank`` 8) gives half of the rank to the keys' spread outside the query subspace; the rows before
it take the query geometry alone (``key_rank: 0``, the paper's).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import oa_core as oa
from oa_core.analysis.offline_model import DEFAULT_MODEL, MODEL_HELP, head_dim, load_offline_model, model_label
from oa_core.eval import ruler, runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--samples", type=int, default=4, help="niah_single_2 samples (default: %(default)s)")
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--density", type=float, default=0.05, help="read density (default: %(default)s)")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: benchmarks/studies/results/selector_rank_<model>.json"
    )
    args = parser.parse_args(argv)
    model, tokenizer = load_offline_model(args.model)
    dim = head_dim(model.config)
    budget = {"density": args.density}
    specs = {"dense": {"budget": {"density": 1.0}}, "oracle": {"budget": budget, "selector": {"name": "oracle"}}}
    for rank in sorted({16, 64, dim}):
        specs[f"qgs rank {rank}"] = {
            "budget": budget,
            "selector": {"name": "qgs", "rank": rank, "rerank": 0, "key_rank": 0},
        }
    specs["qgs rank 16, re-rank 4 (key_rank 0)"] = {"budget": budget, "selector": {"name": "qgs", "key_rank": 0}}
    specs["qgs rank 16, key_rank 8, no re-rank"] = {
        "budget": budget,
        "selector": {"name": "qgs", "key_rank": 8, "rerank": 0},
    }
    specs["default (qgs rank 16, key_rank 8, re-rank 4)"] = {"budget": budget}
    samples = ruler.generate("niah_single_2", tokenizer, length=args.length, count=args.samples, seed=0)
    answers: dict[str, list[float]] = {name: [] for name in specs}
    handle = oa.patch(model, specs["dense"])
    start = time.perf_counter()
    try:
        for sample in samples:
            context = oa.prefill_context(model, runner.encode(tokenizer, sample.context)[None])
            question = runner.encode(tokenizer, sample.question)[None]
            answer = runner.encode(tokenizer, " " + sample.answers[0])[None]
            for name, spec in specs.items():
                handle.use(spec)
                answers[name].append(round(float(oa.answer_logprob(model, context, question, answer).sum()), 3))
    finally:
        oa.unpatch(model)
    result = {
        "benchmark": "selector_rank",
        "model": model_label(args.model),
        "head_dim": dim,
        "task": "niah_single_2",
        "length": args.length,
        "density": args.density,
        "samples": args.samples,
        "setup": "B",
        "answer_logprob": answers,
        "gap_to_dense": {
            name: round(sum(a - d for a, d in zip(v, answers["dense"])) / len(v), 3) for name, v in answers.items()
        },
        "seconds": round(time.perf_counter() - start, 1),
        "command": " ".join(["python", *sys.argv]),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    name = (args.model or DEFAULT_MODEL).replace("/", "_")
    out = args.out or Path("benchmarks/studies/results") / f"selector_rank_{name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, gap in result["gap_to_dense"].items():
        print(f"{name:36s} answer log-lik gap to dense {gap:+.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
