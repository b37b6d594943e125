"""Retrieval as retrieval: needles of several kinds in several texts, answered by each spec beside exact top-k.

    python benchmarks/retrieval.py --model gemma3-270m --tokens 4096 8192   # benchmarks/results/retrieval_<model>.json
    python benchmarks/retrieval.py --model smollm2-135m --specs specs/openattention.yaml my-spec.yaml
    python benchmarks/retrieval.py --model gemma3-270m --device cuda     # the same on a GPU

Each sample's lines go to retrieval_<model>.jsonl as it ends; the same command run again resumes from them.

Per length, ``--samples`` seeded needle prompts (``oa_core.analysis.needle``): sample i hides a 7-digit number, a
hyphenated word pair or a UUID (in turn) in the essays, Python's reference prose or Python source (in turn), at a
random depth. Each context is prefilled once; dense, exact top-k (``specs/oracle-topk.yaml``) and every ``--specs``
file at every density answer it (setup B, sink 4 and local 16 for every sparse spec). Per spec and density:

- accuracy (the value in the greedy answer) and the answer's teacher-forced log-likelihood gap to dense;
- **the recall of the answer's rows**, a diagnostic: at the query that predicts the answer's first token, the rows
  exact top-k reads outside the sink and the local window, and the shares of them that the selector's own scores
  rank within 4 × the budget (the shortlist: what a re-rank can recover), that the spec reads, and that it reads
  weighted by their attention — per diagnosed layer (``--layers``: a model's full-attention layers, at most six
  spread over it) and query head, from one dense capture of the prompt, the spec prepared on the cache before it;
- the selector's scoring bytes per key (``Selector.scoring_bytes``: codes or bounds) and the re-rank's, beside the
  dense row's 2·D·2 bytes of key and value in bf16.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import oa_core as oa
from oa_core.analysis import metrics, needle
from oa_core.analysis.offline_model import MODEL_HELP, capture_attention, head_dim, load_offline_model, model_label
from oa_core.analysis.provenance import provenance
from oa_core.components import group_queries

ROOT = Path(__file__).resolve().parent.parent
SPARSE = {"sink": 4, "local": 16}  # 1% of 4K tokens is 40 rows: below the specs' own 4 + 64
WINDOW = 256  # the integration's prefill query window: the context's last queries
EXACT = "oracle-topk"
RUN_FIELDS = ("model", "kinds", "texts", "seed", "sink", "local", "recall_layers", "specs")  # what a line must share


def full_attention_layers(model, most: int = 6) -> list[int]:
    """The layers attending the whole context (a sliding-window layer is dense over its window), at most ``most``
    spread evenly."""
    kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    count = min(most, len(full))
    return [full[round(j * (len(full) - 1) / max(count - 1, 1))] for j in range(count)]


def answer_row_recall(model, sample: needle.NeedleSample, specs: dict[str, dict], layers: list[int]) -> dict:
    """spec → the shares of the rows exact top-k at the spec's density reads, at the query before the answer's first
    token and outside sink and local, that (1) the selector's own scores rank within 4 × the selectable budget (the
    shortlist a re-rank would see), (2) the spec reads, (3) the spec reads weighted by their attention; averaged over
    ``layers`` and query heads."""
    ids = torch.cat([sample.context_ids, sample.question_ids], 1)
    n = ids.shape[1] - 1  # the cache: every position before the last; the query: the prompt's last
    context = sample.context_ids.shape[1]
    captured = capture_attention(model, ids, layers)
    recalls: dict[str, list[tuple[float, float, float]]] = {name: [] for name in specs}
    exact = oa.load_spec(ROOT / "specs" / f"{EXACT}.yaml").model_dump(mode="json")
    for queries, keys, values, scale in captured.values():
        keys, values, query = keys[:, :, :n].float(), values[:, :, :n].float(), queries[:, :, n : n + 1].float()
        prefill = queries[:, :, context - WINDOW : context].float()
        outside = torch.zeros(n, dtype=torch.bool, device=keys.device)
        outside[SPARSE["sink"] : n - SPARSE["local"]] = True
        layer = (keys, values, prefill, scale, query, outside)
        wanted_at: dict[float, torch.Tensor] = {}  # exact top-k's rows, per density
        weights = None
        for name, spec in specs.items():
            density = spec["budget"]["density"]
            if density not in wanted_at:
                _, state, wanted_at[density] = reads({**exact, **SPARSE, "budget": spec["budget"]}, *layer)
                weights = metrics.attention_weights(query, state).reshape(-1, n)
            pipe, state, read = reads(spec, *layer)
            short = shortlist(pipe, state, query)
            wanted = wanted_at[density]
            got = wanted & read
            for head in range(wanted.shape[0]):
                count = int(wanted[head].sum())
                if count:
                    recalls[name].append(
                        (
                            int((wanted[head] & short[head]).sum()) / count,
                            int(got[head].sum()) / count,
                            float(weights[head][got[head]].sum() / weights[head][wanted[head]].sum()),
                        )
                    )
    return {
        name: tuple(statistics.fmean(row[i] for row in rows) for i in range(3))
        for name, rows in recalls.items()
        if rows
    }


def reads(spec: dict, keys, values, prefill, scale, query, outside) -> tuple:
    """The spec's pipeline, its state on one layer's tensors, and the rows it reads exactly at ``query`` among those
    ``outside`` marks (sink and local excluded), bool ``[Hq, n]``."""
    pipe = oa.build(spec)
    state = pipe.prepare(keys, values, prefill, scale=scale)
    return pipe, state, metrics.exact_reads(pipe, state, query).reshape(-1, outside.shape[0]) & outside


def shortlist(pipe, state, query) -> torch.Tensor:
    """Each query head's best 4 × selectable budget clustered rows by the selector's own scores (before any re-rank),
    bool ``[Hq, n]`` (one batch row, one query)."""
    plan = state.plan()
    if state.clusters is None:  # a state read densely (a budget above the context): every row is "shortlisted"
        return torch.ones(query.shape[1], state.keys.shape[2], dtype=torch.bool, device=query.device)
    grouped = group_queries(query, state.keys.shape[1], pipe.spec.gqa == "shared")
    scores = pipe.selector.score(grouped, state.index, state.keys, state.scale)
    clusters = state.clusters  # positions outside every cluster (sink, local, padding) are read anyway
    scores = scores.masked_fill((clusters.assignment >= clusters.num_clusters)[:, :, None, None, :], -math.inf)
    width = min(4 * int(plan.selectable.max()), scores.shape[-1])
    top = scores.topk(width, dim=-1)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top.indices, top.values > -math.inf)
    heads, kv_heads = query.shape[1], state.keys.shape[1]
    return chosen.expand(-1, -1, heads // kv_heads, -1, -1).reshape(heads, -1)  # a shared selection: every head's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192], help="context lengths")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--densities", type=float, nargs="+", default=[0.03, 0.01])
    parser.add_argument(
        "--specs",
        nargs="+",
        type=Path,
        default=[ROOT / "specs/openattention.yaml"],
        help="spec files, each at every density, named by file stem",
    )
    parser.add_argument("--kinds", nargs="+", default=list(needle.KINDS), choices=needle.KINDS)
    parser.add_argument("--texts", nargs="+", default=["essays", "python-docs", "python-source"])
    parser.add_argument(
        "--layers",
        type=int,
        nargs="*",
        default=None,
        help="layers of the recall diagnostic (default: the full-attention ones, at most six)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (the default), cuda, cuda:1 ...")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/retrieval_<model>.json")
    args = parser.parse_args(argv)
    try:  # every spec checked before the model loads; the density, sink and local are the benchmark's
        named = {
            path.stem: oa.load_spec(path).model_dump(mode="json", exclude={"budget", "sink", "local"})
            for path in [ROOT / "specs" / f"{EXACT}.yaml", *args.specs]
        }
    except oa.SpecError as exc:
        parser.error(str(exc))
    start = time.perf_counter()
    model, tokenizer = load_offline_model(args.model)
    model.to(args.device)
    size = head_dim(model.config)
    layers = args.layers if args.layers is not None else full_attention_layers(model)
    sparse = {
        f"{name} {d:.0%}": {**spec, **SPARSE, "budget": {"density": d}}
        for name, spec in named.items()
        for d in args.densities
    }
    specs = {"dense": {"budget": {"density": 1.0}}, **sparse}
    pipes = {name: oa.build(spec) for name, spec in specs.items()}  # each spec built once, for what it records
    result = {
        "benchmark": "retrieval",
        "model": model_label(args.model),
        "head_dim": size,
        "kinds": args.kinds,
        "texts": args.texts,
        "samples": args.samples,
        "seed": args.seed,
        "setup": "B",
        "sink": SPARSE["sink"],
        "local": SPARSE["local"],
        "recall_layers": layers,
        "specs": {name: pipe.resolved_spec() for name, pipe in pipes.items()},
        "scoring_bytes_per_key": {name: pipes[name].scoring_bytes(size) for name in sparse},
        "lengths": {},
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"retrieval_{(args.model or 'smollm2-135m')}.json"
    # one line per (length, sample, spec), appended as each sample ends: a rerun resumes
    log = out.with_suffix(".jsonl")
    run = hashlib.sha256(json.dumps({k: result[k] for k in RUN_FIELDS}, sort_keys=True).encode()).hexdigest()[:12]
    kept = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    kept = [r for r in kept if r.get("run") == run]  # another configuration's lines stay in the file, unread
    fields = ("answer_rows_in_shortlist", "answer_rows_read", "answer_weight_read")
    for tokens in args.tokens:
        done = {r["sample"] for r in kept if r["tokens"] == tokens}
        samples = needle.make_samples(
            tokenizer, args.samples, tokens, seed=args.seed, kinds=tuple(args.kinds), texts=tuple(args.texts)
        )
        for index, sample in enumerate(tqdm(samples, desc=f"retrieval at {tokens}", unit="sample")):
            if index in done:
                continue
            records = needle.run(model, tokenizer, [sample], specs, progress=False)
            shares = answer_row_recall(model, sample, sparse, layers)
            with log.open("a") as stream:
                for record in records:
                    record.update({"run": run, "tokens": tokens, "sample": index})
                    record.update(
                        {field: round(share, 4) for field, share in zip(fields, shares.get(record["spec"], ()))}
                    )
                    stream.write(json.dumps(record) + "\n")
            kept.extend(records)
        records = [r for r in kept if r["tokens"] == tokens and r["sample"] < args.samples]
        summary = needle.summarize(records)
        for name, row in summary.items():
            rows = [r for r in records if r["spec"] == name and fields[0] in r]
            row["correct"] = sum(r["correct"] for r in records if r["spec"] == name)
            row.update({field: round(statistics.fmean(r[field] for r in rows), 4) for field in fields if rows})
        result["lengths"][str(tokens)] = {"summary": summary, "records": records}
        print(f"\n{tokens} tokens, {model_label(args.model)}:")
        print(
            f"{'spec':24s} {'correct':>8s} {'log-lik gap':>12s} {'in shortlist':>13s} {'rows read':>10s} "
            f"{'weight read':>12s}"
        )
        for name, row in summary.items():
            shares = [row.get(field, math.nan) for field in fields]
            print(
                f"{name:24s} {row['correct']:>5d}/{row['samples']:<2d} {row['logprob_gap']:>+12.3f} "
                f"{shares[0]:>13.3f} {shares[1]:>10.3f} {shares[2]:>12.3f}"
            )
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["machine"] = {
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(model.device),
        "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
    }
    result["provenance"] = provenance(model.device)
    result["command"] = "python benchmarks/retrieval.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
