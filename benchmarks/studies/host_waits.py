"""How often a decode step converts a tensor to a host value (each one a wait on the device on a GPU).

    python benchmarks/studies/host_waits.py [--spec specs/openattention.yaml] [--steps 10]

Runs a tiny random Llama (one layer, 9 query / 3 KV heads) through the transformers integration on the CPU, and
counts, during ``steps`` greedy decode steps after the question, every ``Tensor.__bool__ / item / __int__ /
__float__ / tolist / cpu``, ``torch.equal`` and ``torch.unique`` (its output's size is the data's) call by the frame
that made it. On the CPU every such call is counted
(host-side tensors too), so the total bounds the waits a GPU would see. Writes
benchmarks/studies/results/host_waits.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import traceback
from pathlib import Path

import torch

CONVERSIONS = ("__bool__", "item", "__int__", "__float__", "tolist", "cpu")
FUNCTIONS = ("equal", "unique")  # torch functions that wait on the device too


def count(spec: str, steps: int) -> collections.Counter:
    from transformers import LlamaConfig, LlamaForCausalLM

    import oa_core as oa

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=144,
            intermediate_size=128,
            head_dim=16,
            num_hidden_layers=1,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=4096,
        )
    ).eval()
    oa.patch(model, oa.load_spec(spec).model_dump() | {"sink": 4, "local": 16})
    context = oa.prefill_context(model, torch.randint(100, 1000, (2, 1500)))
    question = torch.randint(100, 1000, (2, 20))
    oa.generate_from_context(model, context, question, max_new_tokens=3, pad_token_id=0)  # prepare, question
    counts: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}
    functions = {name: getattr(torch, name) for name in FUNCTIONS}

    def site() -> str:
        frame = traceback.extract_stack(limit=4)[0]
        return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"

    def counted(name):
        def conversion(self, *args, **kwargs):
            counts[f"{name} @ {site()}"] += 1
            return originals[name](self, *args, **kwargs)

        return conversion

    def counted_function(name, function):
        def call(*args, **kwargs):
            counts[f"{name} @ {site()}"] += 1
            return function(*args, **kwargs)

        return call

    try:
        for name in CONVERSIONS:
            setattr(torch.Tensor, name, counted(name))
        for name, function in functions.items():
            setattr(torch, name, counted_function(name, function))
        oa.generate_from_context(
            model, context, question, max_new_tokens=steps + 1, min_new_tokens=steps + 1, pad_token_id=0
        )
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, function in functions.items():
            setattr(torch, name, function)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="specs/openattention.yaml")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    counts = count(args.spec, args.steps)
    total = sum(counts.values())
    for where, n in counts.most_common():
        print(f"{n:5d}  {where}")
    print(f"{total} conversions over {args.steps} decode steps (+ the question's last block) of one layer")
    out = Path(__file__).parent / "results" / "host_waits.json"
    out.write_text(
        json.dumps(
            {
                "spec": args.spec,
                "steps": args.steps,
                "total": total,
                "machine": "cpu",
                "by_site": dict(counts.most_common()),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
