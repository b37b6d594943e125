"""Two-stage selection: a cheap selector's scores pick a shortlist, exact logits from the keys re-rank it.

A selector's scores only rank keys (``Selector.score``). Reading the keys of a shortlist of a few times the budget,
its best by the cheap scores, and scoring those exactly makes the ranking inside the shortlist the oracle's, for that
many K rows more (at 4 × the budget: 11% of the keys at 3% read, 3% at 1%): ``rerank_exact`` is the stage,
``Selector.refine`` the hook where a selector applies it (QGS: ``rerank``).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from oa_core.ops.scatter import gather_rows, gathers_more_than_it_holds
from oa_core.ops.selection import best_of


def exact_logits(query: Tensor, keys: Tensor, scale: float) -> Tensor:
    """query ``[B, Hkv, Gs, G, T, D]``, keys ``[B, Hkv, N, D]`` → ``[B, Hkv, Gs, T, N]`` float32: s·q·k of every key,
    the largest over each selection head's G query heads (the oracle selector's scores)."""
    B, Hkv, Gs, G, T, D = query.shape
    logits = scale * query.float().reshape(B, Hkv, -1, D) @ keys.float().transpose(-1, -2)
    return logits.view(B, Hkv, Gs, G, T, -1).amax(3)


def rerank_exact(
    scores: Tensor, query: Tensor, keys: Tensor, scale: float, multiple: float, budget: Tensor, width: int
) -> Tensor:
    """scores ``[B, Hkv, Gs, T, N]`` (-inf: not selectable), query ``[B, Hkv, Gs, G, T, D]``, keys ``[B, Hkv, N, D]``
    → scores of the same shape where each row's shortlist — its best ⌈``multiple`` × budget⌉ positions by
    ``scores``, budget ``[B, Hkv, 1, 1]`` the row's selectable rows, at most ``width`` (a bound known on the host) —
    holds their exact logits (``exact_logits``: s·q·k, the largest over the selection head's G query heads), and
    every other selectable position ranks below all of them, in its old order. -inf stays -inf; ties at the cut go
    to the earlier position. Where a KV head's shortlists (Gs·T of them) list more rows than its cache holds, every
    key is scored once instead of gathering them (fewer bytes read; the same logits up to rounding). Nothing waits on
    a GPU."""
    N = scores.shape[-1]
    longest = min(N, math.ceil(multiple * width))
    if longest <= 0:
        return scores
    B, Hkv, Gs, G, T, D = query.shape
    length = torch.ceil(multiple * budget.double()).long().clamp_max(longest)[..., None]  # [B, Hkv, 1, 1, 1]
    cut, top, listed = best_of(scores, longest, length)  # at a tie in the cut, the earlier positions
    if gathers_more_than_it_holds(Gs * T * longest, keys):
        exact = exact_logits(query, keys, scale).gather(-1, top)
    else:  # the rows gathered first, then cast: a cast of the whole cache would read and write all of it
        rows = gather_rows(keys, top.reshape(B, Hkv, -1)).float().view(B, Hkv, Gs, T, longest, D)
        exact = scale * torch.einsum("bhsgtd,bhstld->bhsgtl", query.float(), rows).amax(3)
    # The rest go below the shortlist's lowest exact logit: shifted by (lowest exact − the lowest listed cheap
    # score) − 1, which keeps their order (each scored at most that lowest one).
    lowest = exact.masked_fill(~listed, math.inf).amin(-1, keepdim=True)
    last = cut.masked_fill(~listed, math.inf).amin(-1, keepdim=True)
    out = scores + torch.where(listed.any(-1, keepdim=True), lowest - last - 1, 0.0)
    return out.scatter(-1, top, torch.where(listed, exact, out.gather(-1, top)))


class RerankConfig(Protocol):
    """What ``ExactRerank`` reads of its selector's config."""

    @property
    def rerank(self) -> float: ...


class ExactRerank:
    """For a selector whose ``Config`` has ``rerank`` (a multiple of the selectable budget): with ``rerank`` > 0 the
    best ``rerank`` × budget rows by its codes' scores are re-scored from their keys (``rerank_exact``). QGS and PQS
    take their ``refines`` and ``refine`` from here."""

    config: RerankConfig

    @property
    def refines(self) -> bool:
        return self.config.rerank > 0

    def refine(
        self, scores: Tensor, query: Tensor, index, keys: Tensor, scale: float, budget: Tensor, width: int
    ) -> Tensor:
        return rerank_exact(scores, query, keys, scale, self.config.rerank, budget, width)
