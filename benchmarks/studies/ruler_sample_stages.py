"""Which stage loses one RULER sample's answer: the default, then one stage changed at a time, on that sample.

A grid's cell says that a spec missed a sample; it does not say whether the selector's shortlist, ErrorGate's floor,
the water-filled quotas or the tail's proxies lost the answer's rows — or whether no row was lost and greedy decoding
flipped between two answers of nearly equal likelihood. This study prefills one sample once and answers it as
``oa eval`` does (setup B) with dense, the default (``specs/openattention.yaml``) and variants that change one stage:

- the selection: no re-rank (``rerank 0``), a longer re-rank (8 × the budget), exact scores (the oracle selector);
- the floor: none (``floor 0``) and the whole budget by score (``floor 1``);
- the tail: mean proxies, and no tail (discard);
- the baselines beside them: QGS's selection and exact top-k.

For each it writes the greedy answer, its score and the answer's teacher-forced log-likelihood; then the recall of the
answer's rows at the query before its first token (``benchmarks/retrieval.py``'s diagnostic: the share of exact
top-k's rows within the selector's shortlist, the share read, and that share weighted by attention).

    python benchmarks/studies/ruler_sample_stages.py --task niah_multikey_1 --sample 12 --length 8192 --density 0.03
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import types
from pathlib import Path

import torch

import oa_core as oa
from oa_core.analysis.offline_model import MODEL_HELP, load_offline_model, model_label
from oa_core.analysis.provenance import provenance
from oa_core.eval import ruler, runner

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import retrieval  # noqa: E402  (the recall diagnostic of the retrieval benchmark)

RECALLED = ("default", "rerank 0", "oracle selector", "qgs")  # the variants whose shortlist the recall compares


def variants(base: dict) -> dict[str, dict]:
    """The default and one stage changed at a time (the module's docstring), every one at ``base``'s budget."""

    def changed(**fields) -> dict:
        spec = copy.deepcopy(base)
        for path, value in fields.items():
            *parents, leaf = path.split("__")
            node = spec
            for key in parents:
                node = node[key]
            node[leaf] = value
        return spec

    def baseline(name: str) -> dict:
        spec = oa.load_spec(ROOT / "specs" / f"{name}.yaml").model_dump(mode="json")
        return {**spec, **{key: base[key] for key in ("budget", "sink", "local")}}

    return {
        "default": base,
        "rerank 0": changed(selector__params__rerank=0),
        "rerank 8": changed(selector__params__rerank=8),
        "oracle selector": changed(selector={"name": "oracle", "params": {}}),
        "floor 0": changed(allocator__params__floor=0.0),
        "floor 1": changed(allocator__params__floor=1.0),
        "mean proxies": changed(proxy="mean"),
        "discard": changed(tail="discard"),
        "qgs": baseline("ablate-selector-qgs"),
        "exact top-k": baseline("oracle-topk"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    parser.add_argument("--task", default="niah_multikey_1", choices=sorted(ruler.TASKS))
    parser.add_argument("--sample", type=int, default=12, help="the sample's index (seed 0, as oa eval's)")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--density", type=float, default=0.03)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--local-window", dest="local", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="default: results/ruler_sample_stages_<...>.json")
    args = parser.parse_args(argv)
    if args.sample < 0:
        parser.error(f"--sample: expected 0 or more, got {args.sample}")
    if not 0 < args.density < 1:
        parser.error(f"--density: expected a share of the context in (0, 1), got {args.density}")

    base = oa.load_spec(ROOT / "specs" / "openattention.yaml").model_dump(mode="json")
    base.update(sink=args.sink, local=args.local, budget={"density": args.density, "tokens": None})
    specs = variants(base)
    model, tokenizer = load_offline_model(args.model)
    sample = ruler.generate(args.task, tokenizer, args.length, args.sample + 1, seed=0)[args.sample]
    context_ids, context_mask, question_ids = runner.batch_prompts(tokenizer, [sample])
    answer_ids, answer_mask = runner._padded(
        [runner.encode(tokenizer, runner.reference_answer(sample))], runner.pad_id(tokenizer), left=False
    )
    context = oa.prefill_context(model, context_ids, context_mask)
    handle = oa.patch(model, {"budget": {"density": 1.0}}, setup="B")
    answers = {}
    try:
        for name, spec in [("dense", {"budget": {"density": 1.0}}), *specs.items()]:
            handle.use(spec)
            new, _, density, logprobs = runner._answer(
                model, tokenizer, handle, context, question_ids, answer_ids, answer_mask, sample.max_new_tokens
            )
            output = tokenizer.decode(new[0], skip_special_tokens=True)
            answers[name] = {
                "output": output,
                "score": ruler.score(sample.metric, output, sample.answers),
                "answer_logprob": round(logprobs[0], 4),
                "measured_density": round(density, 4),
            }
            print(f"{name:16s} {answers[name]['score']:5.1f}  log-lik {logprobs[0]:7.2f}  {output!r}", flush=True)
    finally:
        handle.unpatch()
    layers = retrieval.full_attention_layers(model)
    prompt = types.SimpleNamespace(context_ids=context_ids, question_ids=question_ids)
    recall = retrieval.answer_row_recall(model, prompt, {name: specs[name] for name in RECALLED}, layers)
    for name, (shortlist, read, weighted) in recall.items():
        print(f"recall {name:16s} shortlist {shortlist:.3f}  read {read:.3f}  weighted {weighted:.3f}")
    result = {
        "what": __doc__.split("\n\n")[0],
        "model": model_label(args.model),
        "task": args.task,
        "sample": args.sample,
        "length": args.length,
        "density": args.density,
        "sink": args.sink,
        "local": args.local,
        "answers_expected": sample.answers,
        "answers": answers,
        "recall_layers": layers,
        "recall": {
            name: dict(zip(("shortlist", "read", "read_weighted"), (round(v, 4) for v in values)))
            for name, values in recall.items()
        },
        "provenance": provenance(torch.device("cpu")),
    }
    out = args.out or ROOT / "benchmarks/studies/results" / (
        f"ruler_sample_stages_{args.model}_{args.task}_{args.length}_{args.sample}_{args.density:g}.json"
    )
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
