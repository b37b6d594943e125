"""What the decode step's cost model (``step_cost.py``) measures on the offline models: per attend of the default per
head, how far a GQA group's heads read the same rows (the union factors), what issue 56's one-program design would
write and re-read, and what the built per-cluster selection reads of the member lists and the scores."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch

import oa_core as oa
from oa_core.components import group_queries
from oa_core.ops.selection import order_keys

SPEC = Path(__file__).resolve().parents[1] / "specs" / "openattention.yaml"
# The measures' setting: context tokens per model (the longest each takes here: SmolLM2's 8,192 positions less the
# decode queries; Gemma-3-270M at the step's 16K), the decode queries after them, layers, sink and window.
MEASURE = {
    "tokens": {"smollm2-135m": 8176, "gemma3-270m": 16384},
    "decode": 16,
    "layers": 3,
    "sink": 4,
    "local": 16,
}


class Decisions(NamedTuple):
    """What one attend of some queries over a state decides, as the factors below read it: the explanation, the
    selector's own scores (-inf outside the clusters) ``[B, Hkv, G, T, N]``, the shortlist's length and its positions
    (``listed``, same shape), and the selected positions outside the sink and window (``chosen``, over
    ``explanation.selection.index``)."""

    explanation: Any
    scores: torch.Tensor
    length: int
    listed: torch.Tensor
    chosen: torch.Tensor


def decisions(pipe: oa.Pipeline, state, queries: torch.Tensor) -> Decisions:
    """One attend of ``queries`` ``[B, Hq, T, D]`` over ``state`` per head, explained once for every factor: the
    shortlist is the best ⌈rerank × E_sel⌉ rows by the selector's own scores."""
    explanation = pipe.explain(queries, state)
    plan = state.plan()
    Hkv, n = state.keys.shape[1], state.num_tokens
    grouped = group_queries(queries, Hkv, False)
    scores = pipe.selector.score(grouped, state.index, state.keys, state.scale)
    assert plan.unclustered is not None
    scores = scores.masked_fill(plan.unclustered, -math.inf)  # [B, Hkv, G, T, N]
    multiple = getattr(pipe.selector.config, "rerank", 0.0)
    length = max(1, math.ceil(multiple * int(plan.max_selectable)))
    top = scores.topk(min(length, n), dim=-1).indices
    listed = torch.zeros(*scores.shape, dtype=torch.bool).scatter_(-1, top, True)
    index = explanation.selection.index  # [B, Hkv, G, T, K], -1 padding
    fixed = plan.fixed[:, :, None, None, :]  # [B, Hkv, 1, 1, F]
    chosen = (index >= 0) & ~(index[..., :, None] == fixed[..., None, :]).any(-1)
    return Decisions(explanation, scores, length, listed, chosen)


def union_factors(decided: Decisions) -> tuple[float, float]:
    """(shortlist, selection) union factors of one attend (``decisions``): the mean over (batch row, KV head, query)
    of |∪_g rows of head g| / the mean rows of one head, for the shortlist and for the selected rows (sink and window
    left out)."""
    listed, chosen, n = decided.listed, decided.chosen, decided.scores.shape[-1]
    shortlist = listed.any(2).sum(-1).double().mean() / listed.sum(-1).double().mean()
    index = decided.explanation.selection.index
    rows = torch.zeros(*index.shape[:-1], n + 1, dtype=torch.bool)
    rows.scatter_(-1, torch.where(chosen, index, n), True)
    rows = rows[..., :n]
    selected = rows.any(2).sum(-1).double().mean() / rows.sum(-1).double().mean().clamp_min(1)
    return float(shortlist), float(selected)


CHUNKS = 16  # a one-program step's passes over a row of codes: 1,024 positions each at 16K
BUCKET_BITS = 20  # an on-chip histogram's resolution: order keys floored to 2^20 (4,096 buckets over float32)


def running_candidates(scores: torch.Tensor, length: int, bucket_bits: int | None = None) -> torch.Tensor:
    """scores ``[R, N]`` (-inf: not selectable) read in ``CHUNKS`` chunks in position order → ``[R, N]`` bool: the
    positions a one-program step would write as candidates: after each chunk, those of the chunk at or above the
    ``length``-th best score seen so far (with ``bucket_bits``, that score's histogram bucket's floor, as a histogram
    of order keys floored to 2^bucket_bits finds it; every finite one while fewer than ``length`` are seen). The
    row's best ``length`` are always among them: the running threshold never exceeds the final cut."""
    R, N = scores.shape
    lowest = torch.iinfo(torch.long).min
    finite = scores > -math.inf
    keys = order_keys(scores).masked_fill(~finite, lowest)
    written = torch.zeros(R, N, dtype=torch.bool)
    ends = torch.linspace(0, N, CHUNKS + 1).round().long().tolist()
    for start, end in itertools.pairwise(ends):
        cut = keys[:, :end].topk(min(length, end), dim=-1).values[:, -1:]  # the length-th best so far
        cut = torch.where(finite[:, :end].sum(-1, keepdim=True) >= length, cut, lowest)
        if bucket_bits is not None:
            cut = torch.where(cut > lowest, (cut >> bucket_bits) << bucket_bits, cut)
        written[:, start:end] = (keys[:, start:end] >= cut) & finite[:, start:end]
    return written


def one_program_factors(decided: Decisions) -> dict[str, float]:
    """What a one-program step (issue 56's design: scores never written whole) would read instead of the scores'
    trips, from one attend (``decisions``), per head: ``candidates`` (exact running threshold) and
    ``candidates_bucketed`` (a histogram's), the mean share of selectable positions written as candidates
    (``running_candidates``); ``outside_shortlist``, the share of selected rows (sink and window left out) not in the
    selector's shortlist; ``reread_codes``, the mean share of a (batch row, KV head)'s selectable positions in clusters
    whose quota for some head exceeds its shortlisted rows there (their codes read again to rank the rest)."""
    explanation, scores, length, listed, chosen = decided
    assert explanation.quotas is not None and explanation.allocation is not None
    flat = scores.reshape(-1, scores.shape[-1])
    selectable = (flat > -math.inf).sum(-1).clamp_min(1)
    exact = (running_candidates(flat, length).sum(-1) / selectable).mean()
    bucketed = (running_candidates(flat, length, BUCKET_BITS).sum(-1) / selectable).mean()
    outside = chosen & ~listed.gather(-1, explanation.selection.index.clamp_min(0))
    assignment = explanation.allocation.assignment  # [B, Hkv, N], C outside the clusters
    C = explanation.quotas.shape[-1]
    members = torch.nn.functional.one_hot(assignment, C + 1)[..., :C].float()  # [B, Hkv, N, C]
    listed_per_cluster = torch.einsum("bhgtn,bhnc->bhgtc", listed.float(), members)
    short = (explanation.quotas > listed_per_cluster).any(2).any(2)  # [B, Hkv, C]: some head's quota runs past
    reread = (members.sum(2) * short).sum(-1) / members.sum((2, 3)).clamp_min(1)
    return {
        "candidates": float(exact),
        "candidates_bucketed": float(bucketed),
        "outside_shortlist": float(outside.sum() / chosen.sum().clamp_min(1)),
        "reread_codes": float(reread.mean()),
    }


SECTOR = 32  # bytes: the least a GPU reads from memory at a time (8 float32 scores)


def selection_factors(decided: Decisions) -> dict[str, float]:
    """What the built per-cluster selection (``oa_core.ops.selection``) reads of one attend (``decisions``), per
    selection row, as shares of the bound that reads everything: ``member_lists``, of the clusterable positions those
    in clusters with a quota (a cluster without one is skipped; one whose quota covers it is copied from its list);
    ``score_sectors``, of the row's 32-byte sectors of scores those holding a position of a cluster whose quota is
    partial (its members' scores gathered, each 4-byte read costing its sector). Means over the rows."""
    explanation = decided.explanation
    assert explanation.quotas is not None and explanation.allocation is not None
    quotas, counts = explanation.quotas, explanation.allocation.counts  # [B, Hkv, G, T, C], [B, Hkv, C]
    C = quotas.shape[-1]
    assignment = explanation.allocation.assignment[:, :, None, None, :].expand(*quotas.shape[:-1], -1)
    clustered = assignment < C
    place = assignment.clamp_max(C - 1)
    quota = quotas.gather(-1, place)  # each position's cluster's quota
    read = clustered & (quota > 0)
    partial = read & (quota < counts[:, :, None, None, :].expand_as(quotas).gather(-1, place))
    per_sector = SECTOR // 4
    N = assignment.shape[-1]
    padded = torch.nn.functional.pad(partial, (0, -N % per_sector))
    sectors = padded.view(*partial.shape[:-1], -1, per_sector).any(-1).sum(-1)
    lists = read.sum(-1) / clustered.sum(-1).clamp_min(1)
    return {
        "member_lists": float(lists.double().mean()),
        "score_sectors": float((sectors / math.ceil(N / per_sector)).double().mean()),
    }


def measure(model: str, densities: list[float]) -> dict:
    """The factors of the default spec per head on an offline model (``MEASURE``'s context for it): per density, the
    mean over three layers."""
    from oa_core.analysis.attention_error import PREFILL_QUERIES, default_layers, haystack_ids, layer_case
    from oa_core.analysis.offline_model import capture_attention, load_offline_model, model_label

    lm, tokenizer = load_offline_model(model)
    tokens, decode = MEASURE["tokens"][model], MEASURE["decode"]
    layers = default_layers(lm.config.num_hidden_layers, MEASURE["layers"])
    captured = capture_attention(lm, haystack_ids(tokenizer, tokens + decode), layers)
    heads_q, heads_kv = lm.config.num_attention_heads, lm.config.num_key_value_heads
    del lm
    out: dict = {
        "model": model_label(model),
        "heads_per_group": heads_q // heads_kv,
        "tokens": tokens,
        "layers": layers,
    }
    out["densities"] = {}
    for density in densities:
        spec = {"budget": {"density": density}, "sink": MEASURE["sink"], "local": MEASURE["local"], "gqa": "per_head"}
        pipe = oa.build({**oa.load_spec(SPEC).model_dump(mode="json"), **spec})
        found, designs = [], []
        for layer in layers:
            case = layer_case(captured[layer], tokens, decode)
            state = pipe.prepare(case.keys, case.values, case.prefill[:, :, -PREFILL_QUERIES:], scale=case.scale)
            decided = decisions(pipe, state, case.queries)
            found.append(union_factors(decided))
            designs.append({**one_program_factors(decided), **selection_factors(decided)})
        out["densities"][str(density)] = {
            "shortlist_union": round(sum(s for s, _ in found) / len(found), 3),
            "selected_union": round(sum(s for _, s in found) / len(found), 3),
            **{key: round(sum(d[key] for d in designs) / len(designs), 4) for key in designs[0]},
        }
    return out


def transfer(union: float, measured_group: int, group: int) -> float:
    """A union factor measured on groups of ``measured_group`` heads, carried to groups of ``group``: the same share
    (u − 1) / (G − 1) of the way from heads that agree (1) to heads that share no row (G)."""
    if measured_group <= 1:
        return 1.0
    return round(1 + (union - 1) / (measured_group - 1) * (group - 1), 3)
