"""Does OpenAttention's static cache keep Gemma-3's sliding window after the prompt? The real Gemma-3-270M (offline
GGUF), a needle in essays, every layer left to the model's own attention (``dense_layers``: the full-attention ones;
the sliding ones always are): greedy decoding on ``handle.static_cache`` against the unpatched model's — the largest
logit difference over the steps, and whether the tokens are the same. CPU; a minute or two.

    python benchmarks/studies/static_sliding_window.py --out benchmarks/studies/results/static_sliding_window.json

The code measured is the ``oa_core`` Python imports (``PYTHONPATH`` may point at another checkout: the record names
that checkout's commit)."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch

import oa_core as oa
from oa_core.analysis.offline_model import haystack_text, load_offline_model

TOKENS = 12


def code_commit() -> str:
    """The commit of the checkout whose ``oa_core`` is imported (``+dirty`` where it has changes)."""
    folder = Path(oa.__file__).resolve().parents[1]
    git = ["git", "-C", str(folder)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return commit + ("+dirty" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="append the run to this JSON file's runs")
    args = parser.parse_args(argv)
    model, tokenizer = load_offline_model("gemma3-270m")
    essay = haystack_text("essays")
    prompt = (
        essay[:6000]
        + "\n\nThe special magic number is 7481923. Remember it.\n\n"
        + essay[6000:9000]
        + "\n\nWhat is the special magic number? The special magic number is"
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids

    def greedy(**kwargs):
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                **kwargs,
            )
        return out.sequences[:, ids.shape[1] :], torch.cat(out.logits)

    tokens, logits = greedy()
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    with oa.patch(model, "specs/openattention.yaml", dense_layers=full) as handle:
        static_tokens, static_logits = greedy(**oa.cache_kwargs(model, handle.static_cache(max_new_tokens=TOKENS)))
    run = {
        "code_commit": code_commit(),
        "prompt_tokens": ids.shape[1],
        "sliding_window": model.config.sliding_window,
        "new_tokens": TOKENS,
        "max_abs_logit_difference": float((static_logits - logits).abs().max()),
        "largest_logit": float(logits.abs().max()),
        "same_tokens": bool(torch.equal(static_tokens, tokens)),
        "answer": tokenizer.decode(tokens[0]),
    }
    print(json.dumps(run))
    if args.out is not None:
        record = (
            json.loads(args.out.read_text()) if args.out.is_file() else {"study": "static_sliding_window", "runs": []}
        )
        record["runs"].append(run)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
