"""Why QGC falls behind key k-means on RULER (README, "Finding"): where its query geometry comes from.

QGC clusters keys in the top-r eigenspace of M̄_q, the second moment of the last 256 prefill queries. Under setup B
those are the context's queries — haystack text — and the question that asks for the needle comes after them. This
benchmark takes RULER samples, captures every layer's attention inputs over context + question, and attends the
prompt's last query (the one that predicts the first answer token) over the cache before it, at one density, with
OpenAttention (QGC) and its key k-means ablation, the query window taken two ways:

- ``context``: the last 256 context queries (what the integration uses under setup B);
- ``question``: the last 256 queries before the decode query (the question's ~40 among them).

Per (sample, layer, query head): the relative output error against dense attention, the attention mass the exact
reads cover, and the needle's share: of the dense attention mass on the answer's tokens in the context, the part
read exactly. QGS's basis is the same query geometry in both specs (QGC shares it; with k-means QGS computes it), so
the window moves both. Writes benchmarks/studies/results/qgc_geometry.json and prints a table.

    python benchmarks/studies/qgc_geometry.py                                   # niah_single_2, samples 0-9, 3%
    python benchmarks/studies/qgc_geometry.py --task niah_multikey_1 --samples 20 --density 0.01
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

import oa_core as oa
from oa_core.analysis import metrics
from oa_core.analysis.attention_error import dense_attention, relative_error
from oa_core.analysis.offline_model import capture_attention, load_offline_model
from oa_core.eval import ruler

ROOT = Path(__file__).resolve().parents[2]
SPECS = {"openattention": "specs/openattention.yaml", "ablate-clusterer-kmeans": "specs/ablate-clusterer-kmeans.yaml"}
WINDOW = 256


def needle_positions(tokenizer, sample: ruler.Sample) -> torch.Tensor:
    """Context token positions that overlap any of the answers' first occurrence in the context."""
    spans = tokenizer(sample.context, return_offsets_mapping=True, add_special_tokens=False).offset_mapping
    found = set()
    for answer in sample.answers:
        start = sample.context.index(answer)
        found |= {i for i, (a, b) in enumerate(spans) if a < start + len(answer) and b > start}
    return torch.tensor(sorted(found))


def attend_and_read(spec: dict, keys, values, prefill, query, scale: float, reference):
    """``spec`` prepared on the cache ``[1, Hkv, n, D]`` (QGC's window ``prefill``) and attending ``query``
    ``[1, Hq, 1, D]`` → (each head's relative error against ``reference``, the true attention weights ``[Hq, n]``, the
    part of them read exactly ``[Hq, n]``)."""
    pipe = oa.build(spec)
    state = pipe.prepare(keys, values, prefill, scale=scale)
    heads, n = query.shape[1], keys.shape[2]
    error = relative_error(pipe.attend(query, state), reference)[0, :, 0]
    weights = metrics.attention_weights(query, state).reshape(heads, n)
    return error, weights, weights * metrics.exact_reads(pipe, state, query).reshape(heads, n)


def measure_sample(model, tokenizer, sample: ruler.Sample, specs: dict[str, dict]) -> list[dict]:
    context = tokenizer(sample.context, add_special_tokens=False, return_tensors="pt").input_ids[0]
    question = tokenizer(sample.question, add_special_tokens=False, return_tensors="pt").input_ids[0]
    ids = torch.cat([context, question])[None]
    needle = needle_positions(tokenizer, sample)
    captured = capture_attention(model, ids, range(model.config.num_hidden_layers))
    n = ids.shape[1] - 1  # the cache: every position before the last; the query: the prompt's last position
    ends = {"context": len(context), "question": n}
    rows = []
    for layer, (queries, keys, values, scale) in sorted(captured.items()):
        keys, values, query = keys[:, :, :n].float(), values[:, :, :n].float(), queries[:, :, n : n + 1].float()
        reference = dense_attention(query, keys, values, scale)
        for window, end in ends.items():
            prefill = queries[:, :, end - WINDOW : end].float()
            for name, spec in specs.items():
                error, weights, read = attend_and_read(spec, keys, values, prefill, query, scale, reference)
                measured = zip(
                    error.tolist(),
                    read.sum(-1).tolist(),
                    weights[:, needle].sum(-1).tolist(),
                    read[:, needle].sum(-1).tolist(),
                )
                rows += [
                    {
                        "layer": layer,
                        "head": head,
                        "window": window,
                        "spec": name,
                        "error": round(e, 5),
                        "mass_read": round(m, 5),
                        "needle_mass": round(nm, 6),
                        "needle_read": round(nr, 6),
                    }
                    for head, (e, m, nm, nr) in enumerate(measured)
                ]
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for window in ("context", "question"):
        for name in SPECS:
            mine = [r for r in rows if r["window"] == window and r["spec"] == name]
            out.append(
                {
                    "window": window,
                    "spec": name,
                    "heads": len(mine),
                    "mean_error": statistics.fmean(r["error"] for r in mine),
                    "mass_read": statistics.fmean(r["mass_read"] for r in mine),
                    "needle_share_read": sum(r["needle_read"] for r in mine) / sum(r["needle_mass"] for r in mine),
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--density", type=float, default=0.03)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/studies/results/qgc_geometry.json")
    args = parser.parse_args()
    model, tokenizer = load_offline_model()
    samples = ruler.generate(args.task, tokenizer, args.length, args.samples)
    # The RULER sweep's settings: sink 4 and local 16, the torch kernel (CPU), the spec's own seed.
    specs = {
        name: {
            **oa.load_spec(ROOT / path).model_dump(mode="json", exclude_none=True),
            "sink": 4,
            "local": 16,
            "kernel": "torch",
            "budget": {"density": args.density},
        }
        for name, path in SPECS.items()
    }
    rows = []
    for index, sample in enumerate(tqdm(samples, desc="samples", unit="sample")):
        rows += [{"sample": index, **row} for row in measure_sample(model, tokenizer, sample, specs)]
    summary = summarize(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "task": args.task,
                "length": args.length,
                "density": args.density,
                "samples": args.samples,
                "window": WINDOW,
                "summary": summary,
                "rows": rows,
            }
        )
    )
    print("| window | spec | mean relative error | attention mass read | needle's mass read |\n|---|---|---|---|---|")
    for row in summary:
        print(
            f"| {row['window']} | {row['spec']} | {row['mean_error']:.3f} | {row['mass_read']:.3f} | "
            f"{row['needle_share_read']:.3f} |"
        )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
