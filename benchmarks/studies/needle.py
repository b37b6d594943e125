"""Needle in a haystack on the offline model: dense against OpenAttention at 10/5/3/1% read (setup B).

20 seeded samples at ~4K tokens of essay haystack (``oa_core.analysis.needle``): the context is prefilled once per
sample and its cache reused by every spec; each answers greedily (accuracy: the number appears in the answer) and scores
the true answer teacher-forced (log-likelihood gap to dense). Writes benchmarks/studies/results/needle_smollm2.json.

    python benchmarks/studies/needle.py
    python benchmarks/studies/needle.py --model meta-llama/Llama-3.1-8B --tokens 32000
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

import oa_core as oa
from oa_core.analysis import needle
from oa_core.analysis.offline_model import MODEL_HELP, load_offline_model, model_label

# sink 4 + local 16 for every density: 1% of 4K tokens is 40 rows, below the default sink + local of 68.
SPARSE = {"sink": 4, "local": 16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=4096, help="context length in tokens")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.05, 0.03, 0.01])
    parser.add_argument("--dense-layers", type=int, nargs="*", default=[], help="layers kept dense")
    parser.add_argument(
        "--specs",
        nargs="+",
        type=Path,
        default=[Path("specs/openattention.yaml")],
        help="spec files each run at every density, named by file stem (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the model runs (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/studies/results/needle_smollm2.json"))
    args = parser.parse_args(argv)

    # Each spec checked before the model loads; its own budget, sink and local give way to the density and SPARSE.
    try:
        sparse = {
            path.stem: oa.load_spec(path).model_dump(mode="json", exclude={"budget", "sink", "local"})
            for path in args.specs
        }
    except oa.SpecError as exc:
        parser.error(str(exc))
    start = time.perf_counter()
    model, tokenizer = load_offline_model(args.model)
    model.to(args.device)
    samples = needle.make_samples(tokenizer, args.samples, args.tokens, seed=args.seed)
    specs = {"dense": {"budget": {"density": 1.0}}}
    specs.update(
        {
            f"{name} {d:.0%}": {**spec, **SPARSE, "budget": {"density": d}}
            for name, spec in sparse.items()
            for d in args.densities
        }
    )
    # Oracle top-k at 3%: tells the method's losses from what a 3% read costs this model at all.
    specs["oracle top-k 3%"] = {
        **SPARSE,
        "budget": {"density": 0.03},
        "selector": "oracle",
        "allocator": "global",
        "tail": "discard",
    }
    records = needle.run(model, tokenizer, samples, specs, dense_layers=tuple(args.dense_layers))
    summary = needle.summarize(records)
    result = {
        "benchmark": "needle",
        "model": f"{model_label(args.model)}, float32",
        "task": "one 7-digit magic number in an essay haystack (RULER niah_single_2 wording), chat template",
        "setup": "B: context prefilled densely once per sample; question and answer decoded sparsely",
        "tokens": args.tokens,
        "samples": args.samples,
        "seed": args.seed,
        "device": args.device,
        "dense_layers": args.dense_layers,
        "specs": {name: oa.load_spec(spec).model_dump(mode="json") for name, spec in specs.items()},
        "summary": summary,
        "records": records,
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
        },
        "seconds": round(time.perf_counter() - start, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    width = max(map(len, summary)) + 1
    print(f"\n{'spec':{width}s} {'accuracy':>9s} {'density':>8s} {'log-lik gap':>12s}")
    for name, row in summary.items():
        print(f"{name:{width}s} {row['accuracy']:>9.2f} {row['density']:>8.4f} {row['logprob_gap']:>12.3f}")
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
