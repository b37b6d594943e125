"""Could an upper bound on PQS's scores let the step skip keys, instead of looking up every key's 64 sub-spaces for
every query head?

Per head the default's scores are lookups: Σ_m T[m, code_m(i)] over M = D/2 sub-spaces, for each of the group's heads,
and on the GPU those lookups bound the step (``docs/results.md``, "The scores"). A key can only enter a head's
shortlist (its best ``rerank`` × budget scores) if its score reaches the shortlist's cut τ, so any bound that falls
below τ skips a key exactly — the shortlist is unchanged. Three bounds, each given the exact cut (the best a running
threshold could do; for the first, also the cut a pass could find), measured as the share of the clusterable keys
that survive them, the keys still to be scored:

- ``sub-spaces k/M``: the k sub-spaces whose table entries spread most (max − min over the 16 centroids) looked up,
  the rest bounded by their largest entry: Σ_{m∈S} T[m, code_m(i)] + Σ_{m∉S} max_c T[m, c]; ``cut found``: against
  the cut the same pass can know, the shortlist's length-th best lower bound (the rest's smallest entries instead);
- ``blocks of B``: B consecutive positions bounded together by Σ_m (the largest entry among the block's codes of m);
- ``QGC clusters``: the same bound over each of the default's clusters (its 64 clusters, from the prefill queries).

On the default's own index and clusters (``specs/openattention.yaml`` with sink 4 and local 16, prepared on the
cache), per needle prompt (``oa_core.analysis.needle``) at the query before the answer, per full-attention layer and
query head; the mean share and the largest (the worst head).

    python benchmarks/studies/score_bounds.py                        # both models, 8 samples at 4K tokens (CPU)
    python benchmarks/studies/score_bounds.py --model smollm2-135m --samples 2 --tokens 1024
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import oa_core as oa  # noqa: E402
from code_forms_recall import needle_prompts, study_arguments, write_study  # noqa: E402
from oa_core.analysis.offline_model import capture_attention, model_label  # noqa: E402
from oa_core.components import group_queries  # noqa: E402
from oa_plugins.selectors.pq import unpack_codes  # noqa: E402
from retrieval import SPARSE, WINDOW  # noqa: E402

SHORTLIST = 4  # the default's rerank: the shortlist is 4 × the selectable budget
SHARES = (0.125, 0.25, 0.5)  # k/M: the sub-spaces looked up
BLOCKS = (16, 64)


def survivors(tables, codes, clusterable, assignment, clusters, cut, length) -> dict[str, torch.Tensor]:
    """Per bound, the share of the clusterable keys it keeps ``[Hq]``. tables ``[Hq, M, C]`` (the scale folded in),
    codes ``[Hq, M, n]`` (each head's KV head's), clusterable ``[n]``, assignment ``[n]`` (``clusters`` outside
    them), cut ``[Hq, 1]``: each head's shortlist cut, the ``length``-th best score."""
    Hq, M, C = tables.shape
    n = codes.shape[-1]
    entries = tables.gather(2, codes.long())  # [Hq, M, n]: each key's entry per sub-space
    top = tables.amax(-1)  # [Hq, M]
    total = clusterable.sum()
    kept: dict[str, torch.Tensor] = {}
    for share in SHARES:
        k = max(1, int(M * share))
        looked = torch.zeros_like(top, dtype=torch.bool).scatter_(
            1, (tables.amax(-1) - tables.amin(-1)).topk(k, -1).indices, True
        )
        partial = (entries * looked[..., None]).sum(1)
        bound = partial + (top * ~looked).sum(-1, keepdim=True)
        kept[f"sub-spaces {k}/{M}"] = ((bound >= cut) & clusterable).sum(-1) / total
        # Without the exact cut: the L-th best lower bound (the rest's smallest entries) is a cut no higher than it.
        lower = (partial + (tables.amin(-1) * ~looked).sum(-1, keepdim=True)).masked_fill(~clusterable, -math.inf)
        found = lower.topk(length, -1).values[:, -1:]
        kept[f"sub-spaces {k}/{M}, cut found"] = ((bound >= found) & clusterable).sum(-1) / total

    for block in BLOCKS:
        kept[f"blocks of {block}"] = _group_share(tables, codes, torch.arange(n) // block, cut, clusterable, total)
    kept["QGC clusters"] = _group_share(tables, codes, assignment.clamp_max(clusters), cut, clusterable, total)
    return kept


def _group_share(tables, codes, group, cut, clusterable, total) -> torch.Tensor:
    """The share of the clusterable keys whose group's bound — per sub-space the largest entry among the codes its
    keys hold, summed — reaches the cut."""
    Hq, M, C = tables.shape
    groups = int(group.max()) + 1
    present = torch.zeros(Hq, M, groups * C, dtype=torch.bool)
    present.scatter_(2, (group * C + codes.long()), True)  # [Hq, M, groups·C]
    masked = torch.where(present.view(Hq, M, groups, C), tables[:, :, None], -math.inf)
    bound = masked.amax(-1).sum(1)  # [Hq, groups]
    return ((bound.gather(1, group.expand(Hq, -1)) >= cut) & clusterable).sum(-1) / total


def run_model(name: str, args) -> dict:
    model, layers, samples = needle_prompts(name, args)
    pipe = oa.build({**oa.load_spec(ROOT / "specs" / "openattention.yaml").model_dump(), **SPARSE, "kernel": "torch"})
    clusters = pipe.clusterer.config.num_clusters
    collected: dict[float, dict[str, list[float]]] = {d: {} for d in args.densities}
    for sample in tqdm(samples, desc=name, unit="sample"):
        ids = torch.cat([sample.context_ids, sample.question_ids], 1)
        n = ids.shape[1] - 1  # the cache: every position before the last; the query: the prompt's last
        for queries, keys, values, scale in capture_attention(model, ids, layers).values():
            keys, values = keys[:, :, :n].float(), values[:, :, :n].float()
            prefill = queries[:, :, max(0, n - WINDOW) : n].float()
            state = pipe.prepare(keys, values, prefill, scale=scale)
            index, Hkv = state.index, keys.shape[1]
            M = index.centroids.shape[2]
            query = group_queries(queries[:, :, n : n + 1].float(), Hkv, False)  # [1, Hkv, g, 1, 1, D]
            g = query.shape[2]
            sub = query.reshape(1, Hkv, g, M, -1)
            tables = scale * torch.einsum("bhgmd,bhmcd->bhgmc", sub, index.centroids).reshape(Hkv * g, M, -1)
            codes = unpack_codes(index.codes, M)[0].transpose(1, 2).repeat_interleave(g, 0)  # [Hq, M, n]
            scores = tables.gather(2, codes.long()).sum(1)  # [Hq, n]
            clusterable = torch.zeros(n, dtype=torch.bool)
            clusterable[SPARSE["sink"] : n - SPARSE["local"]] = True
            scores = scores.masked_fill(~clusterable, -math.inf)
            for density in args.densities:
                budget = max(1, math.ceil(density * n) - SPARSE["sink"] - SPARSE["local"])
                length = min(SHORTLIST * budget, int(clusterable.sum()))
                cut = scores.topk(length, -1).values[:, -1:]
                for h in range(Hkv):  # each KV head's clusters
                    heads = slice(h * g, (h + 1) * g)
                    assignment = state.cluster_sums.assignment[0, h]
                    kept = survivors(tables[heads], codes[heads], clusterable, assignment, clusters, cut[heads], length)
                    for bound, share in kept.items():
                        collected[density].setdefault(bound, []).extend(share.tolist())
    summary = {
        f"{d:g}": {b: {"mean": statistics.fmean(v), "largest": max(v), "heads": len(v)} for b, v in found.items()}
        for d, found in collected.items()
    }
    return {"model": model_label(name), "layers": layers, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    out = ROOT / "benchmarks" / "studies" / "results" / "score_bounds.json"
    args = study_arguments(argv, __doc__ or "", out, samples=8)
    start = time.perf_counter()
    models = [run_model(name, args) for name in args.model]
    write_study(args, __doc__ or "", models, start)
    for entry in models:
        for density, found in entry["summary"].items():
            for bound, s in found.items():
                print(
                    f"{entry['model'][:14]:14} {float(density):>4.0%} {bound:18} keys kept {s['mean']:.3f} "
                    f"(worst head {s['largest']:.3f})"
                )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
