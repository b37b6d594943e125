"""``oa demo``: a needle in a few thousand tokens of essays, answered by dense attention and by OpenAttention.

The offline SmolLM2-135M-Instruct reads one seeded sample (``oa_core.analysis.needle``): the context is prefilled once,
densely; then each method decodes the question and the answer from its own copy of that cache (setup B).
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

import torch

from oa_core.analysis import needle
from oa_core.analysis.offline_model import load_offline_model
from oa_core.analysis.provenance import provenance
from oa_core.spec import load_spec

# The paper's pipeline (no re-rank, no floor, mean proxies), shown beside the default.
PAPER = Path(__file__).resolve().parents[2] / "specs" / "openattention-paper.yaml"  # in a checkout


def check_demo(tokens: int, density: float) -> None:
    """A clear error, before the model loads, for a density or a context the demo cannot show sparse attention on."""
    spec = load_spec({"budget": {"density": density}})  # SpecError: budget.density outside (0, 1]
    most = len(needle.haystack_text()) // needle.CHARS_PER_TOKEN
    if not 200 <= tokens <= most:
        raise ValueError(f"tokens: expected 200 to {most} (the essays' length), got {tokens}")
    if bool(spec.too_short(torch.tensor([tokens])).any()):
        fixed = spec.sink + spec.local
        raise ValueError(
            f"density: {density:g} of {tokens} tokens reads {spec.budget.rows(tokens)} rows, fewer than "
            f"sink + local = {fixed}: it would run dense; pass --tokens {math.ceil(fixed / density)} or "
            "more, or a larger --density"
        )


def run_demo(model: str | None = None, tokens: int = 3000, density: float = 0.03, out: Path | None = None) -> int:
    """Prints the demo; with ``out``, also writes what it printed and the run's records there as JSON (the README's
    demo block is rendered from ``benchmarks/results/demo.json``: ``oa demo --out benchmarks/results/demo.json``)."""
    check_demo(tokens, density)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text)
        lines.extend(text.split("\n"))

    paper = load_spec(PAPER).model_dump(mode="json", exclude={"budget"}) if PAPER.is_file() else None
    lm, tokenizer = load_offline_model(model)
    sample = needle.make_samples(tokenizer, 1, tokens, seed=0)[0]
    name = f"OpenAttention {density:.0%}"
    specs = {"dense": {"budget": {"density": 1.0}}, name: {"budget": {"density": density}}}
    if paper is not None:  # a checkout has specs/; an installed package alone does not
        specs[f"paper's {density:.0%}"] = {**paper, "budget": {"density": density}}
    say(
        f"Needle: 'The special magic number for ... is: {sample.answer}.' at {sample.depth:.0%} of a "
        f"{sample.context_ids.shape[1]}-token context; the question is decoded by each method from one prefill."
    )
    records = needle.run(lm, tokenizer, [sample], specs)
    say(f"\n{'method':18s} {'read density':>12s} {'answer log-lik':>15s} {'correct':>8s}  answer")
    for r in records:
        say(
            f"{r['spec']:18s} {r['density']:>12.4f} {r['answer_logprob']:>15.2f} {r['correct']!s:>8s}  "
            f"{r['output'].strip()!r}"
        )
    times = "; ".join(
        f"{r['spec']}: clustering {r['prepare_s']} s, sparse attention {r['sparse_attend_s']} s" for r in records[1:]
    )
    say(
        f"\nprefill {records[0]['prefill_s']} s (once); {times} (over {lm.config.num_hidden_layers} layers, torch "
        "reference kernel on this machine)"
    )
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "command": f"oa demo --tokens {tokens} --density {density}",
                    "output": lines,
                    "records": records,
                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
                    "provenance": provenance(lm.device),
                },
                indent=1,
            )
            + "\n",
            encoding="utf-8",
        )
    return 0
