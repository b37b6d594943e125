"""Why ErrorGate gives the needle no quota over QGC's clusters (README, "Where OpenAttention loses the needle").

At one answer token's query of one RULER sample, on one layer's KV head, for QGC and key k-means clusters with exact
scores and ErrorGate (the specs of answer_needle_reads.py): the clusters that hold the needle's tokens,
each with its size n_b, ErrorGate's quota q_b, its Gaussian statistics (mean logit z̄_b, spread σ̂_b), its largest
logit, and the rank of its estimate ε̂_b (Eq. 6) among the clusters against the rank of its true mass Σ_{i∈b} e^{z_i}.
Writes benchmarks/studies/results/needle_cluster_quota.json and prints the rows.

    python benchmarks/studies/needle_cluster_quota.py      # sample 0, layer 18, KV head 2, answer token 5
    python benchmarks/studies/needle_cluster_quota.py --sample 8 --layer 18 --token 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import oa_core as oa
from answer_needle_reads import SPECS, WINDOW, teacher_forced  # the script's own folder
from oa_core.analysis import metrics
from oa_core.analysis.offline_model import capture_attention, load_offline_model
from oa_core.eval import ruler
from oa_plugins.allocators.errorgate import log_error_estimate
from qgc_geometry import needle_positions

ROOT = Path(__file__).resolve().parents[2]


def needle_clusters(spec: dict, query, keys, values, prefill, scale: float, kv_head: int, needle) -> list[dict]:
    pipe = oa.build(spec)
    state = pipe.prepare(keys, values, prefill, scale=scale)
    explained = pipe.explain(query, state)
    inputs = explained.allocation
    quotas = explained.quotas[0, kv_head, :, 0]  # [g, C]
    log_error, _ = log_error_estimate(inputs.mean_logit, inputs.logit_var, inputs.counts[:, :, None, None])
    log_error = log_error[0, kv_head, :, 0]
    group = quotas.shape[0]
    assignment, C = state.pooled.assignment[0, kv_head], state.num_clusters
    logits = metrics.attention_logits(query, state)[0, kv_head, :, 0]  # [g, N]
    member = torch.nn.functional.one_hot(assignment, C + 1)[:, :C].T.bool()  # [C, N]; C: the rows read exactly
    true_mass = torch.logsumexp(logits[:, None, :].masked_fill(~member, -torch.inf), -1)  # [g, C]
    rows = []
    for g in range(group):
        for b in sorted({int(c) for c in assignment[needle]}):
            if b == C:
                rows.append({"head": kv_head * group + g, "cluster": "read exactly"})
                continue
            rows.append(
                {
                    "head": kv_head * group + g,
                    "cluster": b,
                    "size": int(member[b].sum()),
                    "quota": int(quotas[g, b]),
                    "clusters_with_quota": int((quotas[g] > 0).sum()),
                    "needle_tokens": int((assignment[needle] == b).sum()),
                    "mean_logit": round(float(inputs.mean_logit[0, kv_head, g, 0, b]), 3),
                    "logit_sd": round(float(inputs.logit_var[0, kv_head, g, 0, b].sqrt()), 3),
                    "max_logit": round(float(logits[g, member[b]].max()), 3),
                    "estimate_rank": int((log_error[g] > log_error[g, b]).sum()) + 1,
                    "true_mass_rank": int((true_mass[g] > true_mass[g, b]).sum()) + 1,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--sample", type=int, default=0)
    parser.add_argument("--layer", type=int, default=18)
    parser.add_argument("--kv-head", type=int, default=2)
    parser.add_argument("--token", type=int, default=5, help="the answer token whose query attends (0: the first)")
    parser.add_argument("--density", type=float, default=0.03)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/studies/results/needle_cluster_quota.json")
    args = parser.parse_args()
    model, tokenizer = load_offline_model(None)
    sample = ruler.generate(args.task, tokenizer, 4096, args.sample + 1, seed=0)[args.sample]
    ids, context, first = teacher_forced(tokenizer, sample)
    needle = needle_positions(tokenizer, sample)
    queries, keys, values, scale = capture_attention(model, ids, [args.layer])[args.layer]
    n = first + args.token
    query, prefill = queries[:, :, n : n + 1].float(), queries[:, :, context - WINDOW : context].float()
    result = {
        "benchmark": "needle_cluster_quota",
        **{k: v for k, v in vars(args).items() if k != "out"},
        "needle_positions": needle.tolist(),
        "clusters": {},
    }
    for name, path in SPECS.items():
        if "errorgate" not in name:
            continue
        spec = oa.load_spec(ROOT / path).model_dump(mode="json", exclude_none=True)
        spec = {**spec, "sink": 4, "local": 16, "budget": {"density": args.density}}
        rows = needle_clusters(
            spec, query, keys[:, :, :n].float(), values[:, :, :n].float(), prefill, scale, args.kv_head, needle
        )
        result["clusters"][name] = rows
        print(f"== {name}")
        for r in rows:
            print("   " + ", ".join(f"{k} {v}" for k, v in r.items()))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
