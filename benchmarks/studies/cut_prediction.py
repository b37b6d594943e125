"""Could the last step's shortlist cut stand in for a pass over the scores?

The fused step finds each row's shortlist cut (its ⌈rerank × E_sel⌉-th best PQS score) by a radix select of four
8-bit digits of the score's order key: the first digit from ``pq_scores``' histogram, the second and third from a
pass over the row each (``pq_cut``). If consecutive decode steps shared the cut's leading digits, a step could count
the next digit beside its scores, for the keys that share the last step's digits, and skip a pass whenever the guess
held (the same rows either way: a miss takes the pass). This study measures how often they do: on both offline
models (essays, 4,096 tokens of context, the model's own queries at the next 16 positions, three layers; sink 4,
local 16), the default per head, it takes each selection row's cut at each query and counts how often the next
query's cut shares its first 8, 16 and 24 bits.

    python benchmarks/studies/cut_prediction.py        # writes benchmarks/studies/results/cut_prediction.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import oa_core as oa
from oa_core.analysis.provenance import provenance
from oa_core.ops.selection import order_keys

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import step_cost  # noqa: E402 (the cost model's captures and its explained attend)

OUT = ROOT / "benchmarks" / "studies" / "results" / "cut_prediction.json"
PREFIXES = (8, 16, 24)  # the cut's leading bits: one, two and three radix digits


def shared_prefixes(scores, length: int) -> dict[int, float]:
    """scores ``[..., T, N]`` (-inf: not selectable) of T consecutive queries → per prefix width, the share of
    (row, query) pairs whose cut (the ``length``-th best order key) shares that many leading bits with the next
    query's."""
    keys = order_keys(scores) + 2**31  # unsigned 32-bit order keys
    cut = keys.topk(length, dim=-1).values[..., -1]  # [..., T]
    out = {}
    for bits in PREFIXES:
        prefix = cut >> (32 - bits)
        out[bits] = float((prefix[..., 1:] == prefix[..., :-1]).double().mean())
    return out


def measure(model: str | None, densities: list[float]) -> dict:
    from oa_core.analysis.attention_error import PREFILL_QUERIES, default_layers, haystack_ids, layer_case
    from oa_core.analysis.offline_model import capture_attention, load_offline_model, model_label

    setting = step_cost.MEASURE
    lm, tokenizer = load_offline_model(model)
    layers = default_layers(lm.config.num_hidden_layers, setting["layers"])
    captured = capture_attention(lm, haystack_ids(tokenizer, setting["tokens"] + setting["decode"]), layers)
    del lm
    out: dict = {"model": model_label(model), "layers": layers, "densities": {}}
    for density in densities:
        spec = {"budget": {"density": density}, "sink": setting["sink"], "local": setting["local"], "gqa": "per_head"}
        pipe = oa.build({**oa.load_spec(step_cost.SPEC).model_dump(mode="json"), **spec})
        shares = []
        for layer in layers:
            case = layer_case(captured[layer], setting["tokens"], setting["decode"])
            state = pipe.prepare(case.keys, case.values, case.prefill[:, :, -PREFILL_QUERIES:], scale=case.scale)
            decided = step_cost.decisions(pipe, state, case.queries)
            shares.append(shared_prefixes(decided.scores, decided.length))
        out["densities"][str(density)] = {
            f"{bits}_bits": round(sum(s[bits] for s in shares) / len(shares), 3) for bits in PREFIXES
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--densities", nargs="+", type=float, default=step_cost.DENSITIES)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    result = {
        "question": "how often does the next decode query's shortlist cut share its leading bits with this one's?",
        "setting": step_cost.MEASURE,
        "spec": str(step_cost.SPEC.relative_to(ROOT)),
        "models": [measure(model, args.densities) for model in args.models],
        "provenance": provenance(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for entry in result["models"]:
        for density, shares in entry["densities"].items():
            shared = "  ".join(f"{k} {v:.3f}" for k, v in shares.items())
            print(f"{entry['model']:>60} {float(density):>5.0%}  {shared}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
