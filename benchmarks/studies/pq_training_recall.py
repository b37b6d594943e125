"""Would PQS's index keep the rows that matter with fewer Lloyd rounds or fewer training keys?

The default's prepare took 24.6% of the model's prefill in ``generate`` on an H200 (16 × 16K), against a target of
10%, and most of it is PQS's k-means: 8 Lloyd rounds over 4096 training keys in each (batch row, KV head, sub-space),
3.8 ms a round at 16 × 16K on an H100 (``pq_prepare_speed.py``). On the CPU PQS's prepare takes 3–4 × QGS's. Fewer
rounds or keys would cost less; this study measures what they keep, on real queries and keys of both offline models,
with PQS's own code (16 centroids of each pair of dimensions, evenly spaced training keys, ranks for a start):

- ``R rounds, T keys``: the centroids after R Lloyd rounds over at most T training keys (0 rounds: the start alone);
  ``8 rounds, 4096 keys`` is the default.

Per needle prompt, at the query before the answer, per full-attention layer and query head: the share of exact
top-k's rows (outside the sink and the local window) within the shortlist (4 × the selectable budget) each index's
scores rank, the share of their attention, and the lowest share over every (sample, layer, head). At 4K tokens the
region holds fewer than 4096 keys, so ``4096 keys`` is every key there; ``1024 keys`` is one in four.

    python benchmarks/studies/pq_training_recall.py                  # both models, 12 samples at 4K tokens (CPU)
    python benchmarks/studies/pq_training_recall.py --model gemma3-270m --samples 2 --tokens 1024
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from code_forms_recall import ROOT, learnt, study_main

DIMS, CENTROIDS = 2, 16  # PQS's default code
TRAINING = [(8, 4096), (4, 4096), (2, 4096), (1, 4096), (0, 4096), (8, 1024), (4, 1024), (2, 1024)]
FORMS = [f"{rounds} rounds, {keys} keys" for rounds, keys in TRAINING]


def training_scores(query: torch.Tensor, keys: torch.Tensor, outside: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each training's scores ``[Hq, n]`` of the keys ``[Hkv, n, D]`` for the query heads ``[Hq, D]``: the query's dot
    with each key rebuilt from its codes (what PQS's table sums are)."""
    group = query.shape[0] // keys.shape[0]
    return {
        name: torch.einsum(
            "hd,hnd->hn",
            query,
            learnt(keys, outside, DIMS, CENTROIDS, iterations=rounds, train=train).repeat_interleave(group, 0),
        )
        for name, (rounds, train) in zip(FORMS, TRAINING, strict=True)
    }


def main(argv: list[str] | None = None) -> int:
    out = ROOT / "benchmarks" / "studies" / "results" / "pq_training_recall.json"
    return study_main(argv, __doc__ or "", FORMS, out, training_scores)


if __name__ == "__main__":
    raise SystemExit(main())
