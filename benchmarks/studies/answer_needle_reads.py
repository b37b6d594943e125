"""Where OpenAttention loses the needle (README, "Diagnosis"): the answer's own queries, ErrorGate against global.

Teacher-forced, the answer's digits are copied from the needle: at their queries some heads put most of their attention
on the needle's tokens. This benchmark captures every layer's attention inputs over context + question + answer of
RULER samples and attends each answer token's query over the cache before it, at one density, with exact (oracle)
scores and three (clusters, allocator) pairs: QGC + ErrorGate, QGC + global, key k-means + ErrorGate. Per query it
records the needle's attention mass (dense) and the share of it read exactly, and the relative output error; the
summary counts the (layer, head, answer token) whose attention is mostly on the needle (mass > 0.5) but that read
less than a tenth of it exactly — the needle then reaches the output only through its cluster's mean proxy.

    python benchmarks/studies/answer_needle_reads.py            # niah_single_2 samples 0, 1, 8 at 3%, CPU ~6 min
    python benchmarks/studies/answer_needle_reads.py --samples 0 1 2 3 --density 0.01
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

import oa_core as oa
from oa_core.analysis.attention_error import dense_attention
from oa_core.analysis.offline_model import capture_attention, load_offline_model
from oa_core.eval import ruler
from oa_core.eval.runner import reference_answer
from qgc_geometry import attend_and_read, needle_positions  # the script's own folder

ROOT = Path(__file__).resolve().parents[2]
SPECS = {
    "qgc-errorgate": "specs/ablate-selector-oracle.yaml",
    "qgc-global": "benchmarks/studies/diagnosis/qgc-oracle-global.yaml",
    "kmeans-errorgate": "benchmarks/studies/diagnosis/kmeans-oracle-errorgate.yaml",
}
WINDOW = 256  # the integration's prefill query window under setup B: the context's last queries
MOSTLY, MISSED = 0.5, 0.1


def teacher_forced(tokenizer, sample: ruler.Sample) -> tuple[torch.Tensor, int, int]:
    """(token ids ``[1, L]`` of context + question + reference answer, the context's length, the position of the query
    that predicts the answer's first token)."""

    def encode(text: str) -> torch.Tensor:
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]

    context, question, answer = encode(sample.context), encode(sample.question), encode(reference_answer(sample))
    return torch.cat([context, question, answer])[None], len(context), len(context) + len(question) - 1


def measure_sample(model, tokenizer, sample: ruler.Sample, specs: dict[str, dict]) -> list[dict]:
    ids, context, first = teacher_forced(tokenizer, sample)
    needle = needle_positions(tokenizer, sample)
    rows = []
    captured = capture_attention(model, ids, range(model.config.num_hidden_layers))
    for layer, (queries, keys, values, scale) in sorted(captured.items()):
        prefill = queries[:, :, context - WINDOW : context].float()
        for n in range(first, ids.shape[1] - 1):
            k, v, query = keys[:, :, :n].float(), values[:, :, :n].float(), queries[:, :, n : n + 1].float()
            reference = dense_attention(query, k, v, scale)
            for name, spec in specs.items():
                error, weights, read = attend_and_read(spec, k, v, prefill, query, scale, reference)
                measured = zip(error.tolist(), weights[:, needle].sum(-1).tolist(), read[:, needle].sum(-1).tolist())
                rows += [
                    {
                        "layer": layer,
                        "head": head,
                        "token": n - first,
                        "spec": name,
                        "error": round(e, 5),
                        "needle_mass": round(m, 5),
                        "needle_read": round(r, 5),
                    }
                    for head, (e, m, r) in enumerate(measured)
                ]
    return rows


def summarize(rows: list[dict], specs) -> list[dict]:
    out = []
    for name in specs:
        mine = [r for r in rows if r["spec"] == name]
        mostly = [r for r in mine if r["needle_mass"] > MOSTLY]
        out.append(
            {
                "spec": name,
                "queries": len(mine),
                "mean_error": statistics.fmean(r["error"] for r in mine),
                "needle_share_read": sum(r["needle_read"] for r in mine) / sum(r["needle_mass"] for r in mine),
                "mostly_on_needle": len(mostly),
                "mostly_on_needle_missed": sum(r["needle_read"] < MISSED * r["needle_mass"] for r in mostly),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--samples", type=int, nargs="+", default=[0, 1, 8])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--density", type=float, default=0.03)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/studies/results/answer_needle_reads.json")
    args = parser.parse_args()
    model, tokenizer = load_offline_model(None)
    samples = ruler.generate(args.task, tokenizer, args.length, max(args.samples) + 1, seed=0)
    specs = {}
    for name, path in SPECS.items():
        spec = oa.load_spec(ROOT / path).model_dump(mode="json", exclude_none=True)
        specs[name] = {**spec, "sink": 4, "local": 16, "budget": {"density": args.density}}
    result = {
        "benchmark": "answer_needle_reads",
        "task": args.task,
        "length": args.length,
        "density": args.density,
        "specs": {name: str(path) for name, path in SPECS.items()},
        "sink": 4,
        "local": 16,
        "window": WINDOW,
        "note": __doc__.split("\n\n")[1].replace("\n", " "),
        "samples": {},
    }
    every = []  # every query's row (~22k for three samples): summarized; the JSON keeps those mostly on the needle
    for index in tqdm(args.samples, desc="samples"):
        rows = measure_sample(model, tokenizer, samples[index], specs)
        every += rows
        result["samples"][index] = {
            "answer": samples[index].answers,
            "summary": summarize(rows, specs),
            "mostly_on_needle": [r for r in rows if r["needle_mass"] > MOSTLY],
        }
    result["summary"] = summarize(every, specs)
    args.out.write_text(json.dumps(result) + "\n")
    print(f"{'spec':18s} {'mean error':>10s} {'needle read':>11s} {'mostly on needle':>16s} {'of them missed':>14s}")
    for row in result["summary"]:
        print(
            f"{row['spec']:18s} {row['mean_error']:10.4f} {row['needle_share_read']:11.3f} "
            f"{row['mostly_on_needle']:16d} {row['mostly_on_needle_missed']:14d}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
