"""The two-stage selection (oa_core.ops.rerank, QGS's ``rerank``): a shortlist by the cheap scores, re-ranked by exact
logits."""

import math

import pytest
import torch

import oa_core as oa
from oa_core.components import group_queries
from oa_core.ops.rerank import rerank_exact
from oa_core.ops.selection import select, top_counts


def _case(seed=0, B=2, H=2, g=2, N=300, D=16, T=1):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=gen)
    query = torch.randn(B, H * g, T, D, generator=gen)
    return keys, query


def exact_scores(query, keys, scale, shared):
    grouped = group_queries(query, keys.shape[1], shared)
    B, H, Gs, G, T, D = grouped.shape
    logits = scale * torch.einsum("bhsgtd,bhnd->bhsgtn", grouped, keys)
    return grouped, logits.amax(3)


@pytest.mark.parametrize("shared", [False, True])
def test_a_shortlist_that_holds_the_true_top_rows_reranks_to_the_oracles_choice(shared):
    keys, query = _case()
    scale = 0.25
    grouped, exact = exact_scores(query, keys, scale, shared)
    B, H, N = keys.shape[0], keys.shape[1], keys.shape[2]
    budget, multiple = 12, 4.0
    # Cheap scores that keep the true top 48 (= 4 × 12) as their top 48 but in a scrambled order, and scramble the
    # rest below them: only the shortlist's membership is right.
    gen = torch.Generator().manual_seed(5)
    rank = exact.argsort(-1, descending=True).argsort(-1)
    cheap = torch.where(rank < 48, 100 + torch.rand(exact.shape, generator=gen), torch.rand(exact.shape, generator=gen))
    refined = rerank_exact(cheap, grouped, keys, scale, multiple, torch.full((B, H, 1, 1), budget), budget)
    assignment = torch.zeros(B, H, N, dtype=torch.long)  # one cluster: the per-cluster selection is global
    rows = torch.full((B, H, 1, 1), budget)
    chosen = select(refined, assignment, top_counts(refined, assignment, rows, 1, budget), budget)
    oracle = select(exact, assignment, top_counts(exact, assignment, rows, 1, budget), budget)
    assert torch.equal(chosen, oracle)
    # Without the re-rank the scrambled shortlist picks other rows.
    plain = select(cheap, assignment, top_counts(cheap, assignment, rows, 1, budget), budget)
    assert not torch.equal(plain, oracle)


def test_the_rest_rank_below_the_shortlist_in_their_old_order_and_minus_inf_stays():
    keys, query = _case(seed=1, N=200)
    grouped = group_queries(query, keys.shape[1], False)
    cheap = torch.randn(2, 2, 2, 1, 200, generator=torch.Generator().manual_seed(2))
    cheap[..., :30] = -math.inf  # outside the clusters
    budget = torch.tensor([10, 3]).view(2, 1, 1, 1).expand(2, 2, 1, 1)  # rows of a batch differ
    refined = rerank_exact(cheap, grouped, keys, 0.3, 2.0, budget, 10)
    for b, listed in ((0, 20), (1, 6)):
        row, old = refined[b, 0, 0, 0], cheap[b, 0, 0, 0]
        order = old.argsort(descending=True, stable=True)
        inside, outside = order[:listed], order[listed:170]
        assert row[inside].min() > row[outside].max()
        assert torch.equal(
            row[outside].argsort(descending=True, stable=True), old[outside].argsort(descending=True, stable=True)
        )
        assert (row[:30] == -math.inf).all()
        exact = 0.3 * keys[b, 0, inside] @ query[b, 0, 0]
        assert torch.allclose(row[inside], exact, atol=1e-5)


def test_a_zero_multiple_or_budget_leaves_the_scores():
    keys, query = _case(N=64)
    grouped = group_queries(query, keys.shape[1], True)
    cheap = torch.randn(2, 2, 1, 1, 64)
    assert rerank_exact(cheap, grouped, keys, 0.5, 0.0, torch.full((2, 2, 1, 1), 5), 5) is cheap
    assert torch.equal(
        rerank_exact(cheap, grouped, keys, 0.5, 3.0, torch.zeros(2, 2, 1, 1, dtype=torch.long), 5), cheap
    )


def test_qgs_rerank_brings_the_pipeline_to_the_oracle_selection_when_the_shortlist_covers_the_context():
    """With a shortlist of every clusterable row the two-stage QGS reads exactly what the oracle selector reads."""
    keys, query = _case(seed=3, N=400, D=32)
    prefill = torch.randn(2, 4, 64, 32, generator=torch.Generator().manual_seed(4))
    spec = {"budget": {"density": 0.1}, "sink": 4, "local": 16, "gqa": "per_head", "kernel": "torch"}
    values = torch.randn_like(keys)
    rows = {}
    for name, selector in (("oracle", "oracle"), ("two-stage", {"name": "qgs", "params": {"rerank": 100}})):
        pipe = oa.build({**spec, "selector": selector})
        state = pipe.prepare(keys, values, prefill)
        rows[name] = pipe.explain(query, state).selection.index
    assert torch.equal(rows["oracle"], rows["two-stage"])


def test_a_negative_rerank_is_refused_naming_the_field():
    with pytest.raises(oa.SpecError, match="rerank"):
        oa.build({"selector": {"name": "qgs", "params": {"rerank": -1}}})
