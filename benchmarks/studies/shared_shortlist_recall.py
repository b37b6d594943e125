"""Would one shortlist per GQA group, or PQS's tables in half precision, keep each query head's rows as well as the
default's shortlist per head?

Per head (the default, ``gqa: per_head``) the step cuts, lists and re-ranks a shortlist for every query head of a KV
head: on an H200 at 32 × 32K and 1% the cut and the listing take 0.50 ms of the CUDA shortlist's 1.06, and the scores'
64 table lookups a key and head most of the rest (``docs/results.md``). Two cheaper forms, measured here on real
queries and keys of both offline models with PQS's own code (16 centroids of each pair of dimensions, learnt as PQS
learns them):

- ``group max``: one shortlist for the group, the positions best by the max over its heads' scores (what
  ``gqa: shared`` cuts), of 4, 8 and 16 × the selectable budget (16: as many entries as four heads' shortlists, a
  group of Gemma-3 or Llama-3.1; SmolLM2's groups have 3 heads); each head would still take its own rows from it by
  exact logits;
- ``fp16 tables``: each head's scores from table entries q_m·c_{m,j} rounded to float16 and summed in float32;
  ``fp16 sums``: summed in float16 too, one sub-space after another (two heads a 32-bit lookup, as half2 would);
  ``bf16 tables``: rounded to bfloat16 and summed in float32 (two heads a word, each made a float by a shift: the
  forms ``half_table_scores.py`` times on the GPU).

Per needle prompt, at the query before the answer, per full-attention layer and query head: the share of exact
top-k's rows (outside the sink and the local window) within each shortlist, the share of their attention, and the
lowest share over every (sample, layer, head). ``code_forms_recall.py`` runs the same prompts for other codes.

    python benchmarks/studies/shared_shortlist_recall.py                  # both models, 12 samples at 4K tokens (CPU)
    python benchmarks/studies/shared_shortlist_recall.py --model gemma3-270m --samples 2 --tokens 1024
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from code_forms_recall import ROOT, learnt, study_main

DIMS, CENTROIDS = 2, 16  # PQS's default code
FORMS = [
    "per head",
    "per head, fp16 tables",
    "per head, fp16 sums",
    "per head, bf16 tables",
    "group max, 4×",
    "group max, 8×",
    "group max, 16×",
]
# the shortlists' lengths other than SHORTLIST (4) × the selectable budget
MULTIPLES = {"group max, 8×": 8.0, "group max, 16×": 16.0}


def shortlist_scores(query: torch.Tensor, keys: torch.Tensor, outside: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each form's scores ``[Hq, n]`` of the keys ``[Hkv, n, D]`` for the query heads ``[Hq, D]``: PQS's table sums
    (entry m of key i: q_m·c_{m, code_im}), rounded as the form says, or the group's max."""
    Hq, D = query.shape
    Hkv, n, _ = keys.shape
    group, M = Hq // Hkv, D // DIMS
    rebuilt = learnt(keys, outside, DIMS, CENTROIDS).repeat_interleave(group, 0)  # [Hq, n, D]
    entries = (query.view(Hq, 1, M, DIMS) * rebuilt.view(Hq, n, M, DIMS)).sum(-1)  # [Hq, n, M]
    per_head = entries.sum(-1)
    half = entries.half()
    running = torch.zeros(Hq, n, dtype=torch.float16)
    for m in range(M):
        running = running + half[..., m]
    shared = per_head.view(Hkv, group, n).amax(1).repeat_interleave(group, 0)
    brain = entries.bfloat16().float().sum(-1)
    scores = [per_head, half.float().sum(-1), running.float(), brain, shared, shared, shared]
    return dict(zip(FORMS, scores, strict=True))


def main(argv: list[str] | None = None) -> int:
    out = ROOT / "benchmarks" / "studies" / "results" / "shared_shortlist_recall.json"
    return study_main(argv, __doc__ or "", FORMS, out, shortlist_scores, MULTIPLES)


if __name__ == "__main__":
    raise SystemExit(main())
