"""Would a code that a plain dot scores keep the rows that matter as well as PQS's product codes, at the same bytes?

PQS codes each pair of a key's dimensions by the nearest of 16 centroids (4 bits a pair: D/4 bytes a key) and scores a
key by table lookup: on an H100 those lookups take as long as dense attention (``docs/results.md``, per layer). A code
of 2 bits a dimension has the same D/4 bytes, and its key rebuilt from the code is a dot away from the query: no table,
no gather, on tensor cores. This study measures what such codes keep, on real queries and keys of both offline models:

- ``pq 2d×4b``: PQS's code (pairs of neighbouring dimensions, 16 centroids each, Lloyd's k-means as PQS learns
  them); ``rope``: each pair one plane RoPE rotates (dimensions i and i + D/2);
- ``pq 4d×8b``: 256 centroids of each 4 dimensions (the same bytes, half the lookups a key); ``rope``: two planes;
- ``lloyd 1d×2b``: each dimension coded by the nearest of 4 levels learnt by the same k-means (PQS at ``dims`` 1 and
  2 bits: the same code, scored from the rebuilt key);
- ``uniform 1d×2b``: each dimension's range cut in 4 equal steps (nothing learnt).

Per needle prompt (``oa_core.analysis.needle``: a number, a word pair or a UUID in the essays, Python's docs or its
source), one dense capture of context + question; at the query before the answer, per full-attention layer and query
head, exact top-k's rows at the density (outside the sink and the local window) and the share of them each code's
scores rank within 4 × that budget (the shortlist a re-rank sees), the share of their attention that shortlist holds,
and the lowest share over every (sample, layer, head): an average over heads can hide the one that carries the answer.

    python benchmarks/studies/code_forms_recall.py                   # both models, 12 samples at 4K tokens (CPU)
    python benchmarks/studies/code_forms_recall.py --model gemma3-270m --samples 3 --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from oa_core.analysis import needle  # noqa: E402
from oa_core.analysis.offline_model import capture_attention, head_dim, load_offline_model, model_label  # noqa: E402
from oa_core.analysis.provenance import provenance  # noqa: E402
from oa_plugins.selectors.pq import learn_centroids, training_positions  # noqa: E402
from retrieval import SPARSE, full_attention_layers  # noqa: E402

SHORTLIST = 4  # the shortlist: PQS's default re-rank, in multiples of the selectable budget
ITERATIONS = 8  # PQS's Lloyd iterations
TRAIN = 4096  # PQS's training keys


def rope_order(D: int) -> torch.Tensor:
    """The dimensions with each RoPE pair side by side: (0, D/2, 1, D/2 + 1, ...) — transformers' rotate_half turns
    dimension i with i + D/2, so a sub-space of two neighbours in this order is one rotating plane."""
    return torch.stack((torch.arange(D // 2), torch.arange(D // 2) + D // 2), -1).flatten()


def learnt(
    keys: torch.Tensor,
    region: torch.Tensor,
    dims: int,
    count: int,
    rope: bool = False,
    iterations: int = ITERATIONS,
    train: int = TRAIN,
) -> torch.Tensor:
    """keys ``[H, n, D]`` → each key rebuilt from its code: the nearest of ``count`` centroids per ``dims`` dimensions,
    learnt from up to ``train`` keys of ``region`` as PQS learns them (evenly spaced keys, ranks for a start,
    ``iterations`` of Lloyd); ``rope``: the sub-spaces take the dimensions in ``rope_order`` (PQS takes neighbours)."""
    if rope:
        order = rope_order(keys.shape[-1])
        rebuilt = learnt(keys[..., order], region, dims, count, iterations=iterations, train=train)
        return rebuilt[..., torch.argsort(order)]
    H, n, D = keys.shape
    positions, chosen = training_positions(region[None], train)
    centroids = learn_centroids(keys[None], positions, chosen, dims, count, iterations)  # PQS's own k-means
    centroids = centroids.reshape(H * D // dims, count, dims)
    parts = keys.reshape(H, n, D // dims, dims).transpose(1, 2).reshape(H * D // dims, n, dims)
    codes = torch.cdist(parts, centroids).argmin(-1)  # [P, n]
    rebuilt = centroids.gather(1, codes[..., None].expand(-1, -1, dims))
    return rebuilt.reshape(H, D // dims, n, dims).transpose(1, 2).reshape(H, n, D)


def uniform(keys: torch.Tensor, region: torch.Tensor, levels: int) -> torch.Tensor:
    """keys ``[H, n, D]`` → each dimension rounded to the nearest of ``levels`` evenly spaced values over its range in
    ``region``."""
    low = keys[:, region].amin(1, keepdim=True)
    step = (keys[:, region].amax(1, keepdim=True) - low).clamp_min(1e-12) / (levels - 1)
    return low + step * ((keys - low) / step).round().clamp(0, levels - 1)


FORMS = {
    "pq 2d×4b": lambda keys, region: learnt(keys, region, 2, 16),
    "pq 2d×4b rope": lambda keys, region: learnt(keys, region, 2, 16, rope=True),
    "pq 4d×8b": lambda keys, region: learnt(keys, region, 4, 256),
    "pq 4d×8b rope": lambda keys, region: learnt(keys, region, 4, 256, rope=True),
    "lloyd 1d×2b": lambda keys, region: learnt(keys, region, 1, 4),
    "uniform 1d×2b": lambda keys, region: uniform(keys, region, 4),
}


def form_scores(query: torch.Tensor, keys: torch.Tensor, outside: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each of ``FORMS``' scores of the keys ``[Hkv, n, D]`` for the query heads ``[Hq, D]`` → ``[Hq, n]`` each: the
    query's dot with each key rebuilt from the form's code (learnt on the selectable positions ``outside``)."""
    group = query.shape[0] // keys.shape[0]
    return {
        name: torch.einsum("hd,hnd->hn", query, make(keys, outside).repeat_interleave(group, 0))
        for name, make in FORMS.items()
    }


def layer_shares(
    query, keys, scale, outside, density: float, approx: dict[str, torch.Tensor], multiples: dict[str, float]
) -> dict[str, list]:
    """One layer at one query: per form, per query head, (the share of exact top-k's rows in the form's shortlist, the
    share of their attention it holds). query ``[Hq, D]``, keys ``[Hkv, n, D]``, outside ``[n]`` (selectable),
    ``approx``: each form's scores ``[Hq, n]``; a form's shortlist is ``multiples[form]`` (``SHORTLIST`` where it is
    not named) × the selectable budget."""
    Hq, Hkv = query.shape[0], keys.shape[0]
    group = Hq // Hkv
    n = keys.shape[1]
    budget = max(1, math.ceil(density * n) - SPARSE["sink"] - SPARSE["local"])
    exact = scale * torch.einsum("hd,hnd->hn", query, keys.repeat_interleave(group, 0))
    weights = torch.softmax(exact, -1)
    masked = exact.masked_fill(~outside, float("-inf"))
    wanted = torch.zeros_like(masked, dtype=torch.bool).scatter_(-1, masked.topk(budget, -1).indices, True)
    shares: dict[str, list] = {}
    for name, scores in approx.items():
        scores = scores.masked_fill(~outside, float("-inf"))
        length = min(math.ceil(multiples.get(name, SHORTLIST) * budget), n)
        short = torch.zeros_like(wanted).scatter_(-1, scores.topk(length, -1).indices, True)
        rows = ((wanted & short).sum(-1) / budget).tolist()
        mass = ((weights * (wanted & short)).sum(-1) / (weights * wanted).sum(-1)).tolist()
        shares[name] = list(zip(rows, mass))
    return shares


def needle_prompts(name: str, args: argparse.Namespace) -> tuple:
    """An offline model, its full-attention layers and ``args.samples`` needle prompts of ``args.tokens`` tokens (a
    number, a word pair or a UUID in turn, in the essays, Python's docs or its source in turn; seed 0)."""
    model, tokenizer = load_offline_model(name)
    samples = needle.make_samples(
        tokenizer,
        args.samples,
        args.tokens,
        seed=0,
        kinds=needle.KINDS,
        texts=("essays", "python-docs", "python-source"),
    )
    return model, full_attention_layers(model), samples


def run_model(name: str, args, scores=form_scores, multiples: dict[str, float] | None = None) -> dict:
    """One offline model's shares over ``args.samples`` needle prompts; ``scores(query, keys, outside)``: each form's
    scores (``form_scores``); ``multiples``: shortlists of other lengths than ``SHORTLIST`` (``layer_shares``)."""
    model, layers, samples = needle_prompts(name, args)
    collected: dict[float, dict[str, list]] = {d: {} for d in args.densities}
    for sample in tqdm(samples, desc=name, unit="sample"):
        ids = torch.cat([sample.context_ids, sample.question_ids], 1)
        n = ids.shape[1] - 1  # the cache: every position before the last; the query: the prompt's last
        outside = torch.zeros(n, dtype=torch.bool)
        outside[SPARSE["sink"] : n - SPARSE["local"]] = True
        for queries, keys, _, scale in capture_attention(model, ids, layers).values():
            keys, query = keys[0, :, :n].float(), queries[0, :, n].float()
            approx = scores(query, keys, outside)
            for density in args.densities:
                for form, rows in layer_shares(query, keys, scale, outside, density, approx, multiples or {}).items():
                    collected[density].setdefault(form, []).extend(rows)
    summary = {
        f"{density:g}": {
            form: {
                "rows_in_shortlist": statistics.fmean(r for r, _ in rows),
                "attention_in_shortlist": statistics.fmean(m for _, m in rows),
                "lowest_rows_in_shortlist": min(r for r, _ in rows),
                "heads_below_90pct": sum(r < 0.9 for r, _ in rows),
                "heads": len(rows),
            }
            for form, rows in forms.items()
        }
        for density, forms in collected.items()
    }
    return {"model": model_label(name), "head_dim": head_dim(model.config), "layers": layers, "summary": summary}


def study_arguments(argv: list[str] | None, doc: str, out: Path, samples: int = 12) -> argparse.Namespace:
    """The needle studies' arguments: ``--model`` (both offline models), ``--samples``, ``--tokens`` (4096),
    ``--densities`` (1% and 3%) and ``--out`` (``out``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.03])
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args(argv)
    if args.samples < 1 or args.tokens < 256:
        parser.error("--samples at least 1 and --tokens at least 256")
    return args


def write_study(args: argparse.Namespace, doc: str, models: list[dict], start: float, **fields) -> None:
    """A needle study's JSON to ``args.out``: what it asks, ``fields``, its setting (samples, tokens, the shortlist,
    sink and window), each model's results, its time since ``start`` and the provenance."""
    result = {
        "what": doc.split("\n\n")[0],
        **fields,
        "samples": args.samples,
        "tokens": args.tokens,
        "shortlist": f"{SHORTLIST} × the selectable budget",
        "sink": SPARSE["sink"],
        "local": SPARSE["local"],
        "models": models,
        "seconds": round(time.perf_counter() - start, 1),
        "provenance": provenance(torch.device("cpu")),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def study_main(
    argv: list[str] | None,
    doc: str,
    forms: list[str],
    out: Path,
    scores=form_scores,
    multiples: dict[str, float] | None = None,
) -> int:
    """The command line of a study of shortlists on needle prompts (this one's, ``shared_shortlist_recall``'s):
    ``run_model`` on each model, the JSON written to ``--out`` (``out`` by default) and a line per form printed."""
    args = study_arguments(argv, doc, out)
    torch.manual_seed(0)
    start = time.perf_counter()
    models = [run_model(name, args, scores, multiples) for name in args.model]
    write_study(args, doc, models, start, forms=forms, **({"shortlist_multiples": multiples} if multiples else {}))
    for entry in models:
        for density, found in entry["summary"].items():
            for form, s in found.items():
                print(
                    f"{entry['model'][:14]:14} {float(density):>4.0%} {form:22} rows {s['rows_in_shortlist']:.3f} "
                    f"attention {s['attention_in_shortlist']:.3f} lowest {s['lowest_rows_in_shortlist']:.2f} "
                    f"below 90% {s['heads_below_90pct']}/{s['heads']}"
                )
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    out = ROOT / "benchmarks" / "studies" / "results" / "code_forms_recall.json"
    return study_main(argv, __doc__ or "", list(FORMS), out)


if __name__ == "__main__":
    raise SystemExit(main())
