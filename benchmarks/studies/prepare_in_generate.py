"""Prepare where users pay it: inside ``model.generate`` on the fast path (``handle.static_cache``), per prompt.

    python benchmarks/studies/prepare_in_generate.py 1x32768 16x16384 8x32768 --repeats 3

The Llama-3.1-8B-shaped model of ``benchmarks/generate_speed.py`` (32 layers, random bf16 weights), the default spec
at 1% (``gqa: shared``). Per batch × context, ``generate`` calls of 3 tokens, uncompiled (only the prefill is of
interest), each timed to its first token (``prefill_s``):
- ``dense-engine``: the same static cache reading every row (density 1: no prepare), the model's prefill alone;
- ``openattention``: each layer's prepare after its dense attention.
One untimed OpenAttention call first compiles prepare's Triton kernels for the shape; then ``--repeats`` rounds of
the two, interleaved. The prepare's share of the prefill, the issue's target 10%, two ways:
- ``added_share``: the time to the first token it adds — (OpenAttention's median ``prefill_s`` − dense-engine's) /
  dense-engine's — what the user pays, host included;
- ``span_share``: the prepare as the device timed it (``prepare_s``, each layer's in ``spans_ms``, median over the
  calls) over dense-engine's ``prefill_s``.
``met``: both at most 10%. Writes ``benchmarks/studies/results/prepare_in_generate.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import headline_scripts  # noqa: F401 (benchmarks/ on the path: the headline scripts import)
import generate_speed  # the benchmark's model and clock
import oa_core as oa

OUT = Path(__file__).parent / "results" / "prepare_in_generate.json"
TARGET = generate_speed.PREPARE_TARGET  # the issue's: prepare at most 10% of the model's dense prefill
METHODS = ("dense-engine", "openattention")


def one_call(model, ids: torch.Tensor, method: str) -> dict:
    """One ``generate`` call of 3 tokens with ``method`` → its times."""
    density = 1.0 if method == "dense-engine" else 0.01
    handle = oa.patch(model, {"gqa": "shared", "budget": {"density": density}})
    try:
        run = generate_speed.timed_generate(
            model, ids, 1, 2, disable_compile=True, **oa.cache_kwargs(model, handle.static_cache(max_new_tokens=3))
        )
        run = {"method": method, "prefill_s": run["prefill_s"]}
        if method != "dense-engine":
            run["prepare_s"] = handle.stats.prepare_seconds
            run["spans_ms"] = [
                round(float(r.prepare_span) * 1e3, 1) for r in handle.stats.records if r.phase == "prefill"
            ]
    finally:
        handle.unpatch()
        torch.cuda.empty_cache()
    return run


def config_summary(config: str, runs: list[dict]) -> dict:
    """The median time to the first token of each method, and the prepare's share of the model's prefill
    (dense-engine's): the time it adds, and its own time on the device."""
    median = {m: statistics.median(r["prefill_s"] for r in runs if r["method"] == m) for m in METHODS}
    prefill = median["dense-engine"]
    sparse = [r for r in runs if r["method"] == "openattention"]
    added = (median["openattention"] - prefill) / prefill
    span = statistics.median(r["prepare_s"] for r in sparse) / prefill
    return {
        "config": config,
        "median_prefill_s": {m: round(t, 4) for m, t in median.items()},
        "added_s": round(median["openattention"] - prefill, 4),
        "added_share": round(added, 4),
        "span_share": round(span, 4),
        "met": max(added, span) <= TARGET,
        "layer_prepare_ms_median": statistics.median(s for r in sparse for s in r["spans_ms"]),
    }


def shape(text: str) -> tuple[int, int]:
    """``BATCHxCONTEXT`` → (batch, context), both positive."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT of positive integers (e.g. 16x16384), got {text!r}")
    return int(parts[0]), int(parts[1])


def rounds(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of rounds, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "configs",
        nargs="*",
        type=shape,
        default=[(16, 16384), (8, 32768), (1, 32768)],
        help="BATCHxCONTEXT (default: 16x16384 8x32768 1x32768)",
    )
    parser.add_argument("--repeats", type=rounds, default=2, help="rounds of the two methods (default: 2)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    model = generate_speed.build_model(False, None, device)
    runs, summaries = [], []
    for batch, context in args.configs:
        config = f"{batch}x{context}"
        ids = torch.randint(
            10, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0)
        ).to(device)
        one_call(model, ids, "openattention")  # compiles prepare's kernels for the shape: not timed
        rows = []
        for repeat in range(args.repeats):
            for method in METHODS:
                rows.append({"config": config, "repeat": repeat, **one_call(model, ids, method)})
                print(json.dumps(rows[-1]), flush=True)
        runs += rows
        summaries.append(config_summary(config, rows))
        print(json.dumps(summaries[-1]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"device": torch.cuda.get_device_name(), "target": TARGET, "summary": summaries, "runs": runs}, indent=1
            )
            + "\n"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
