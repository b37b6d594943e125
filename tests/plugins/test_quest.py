"""Quest's page bounds (Tang et al., ICML 2024) and page-wise selection."""

import math

import torch

import oa_core as oa
from conftest import make_inputs
from oa_core.components import Clusters, group_queries
from oa_plugins.selectors.oracle import OracleSelector
from oa_plugins.selectors.quest import QuestConfig, QuestSelector


def _region(batch, tokens, start, end):
    assignment = torch.full((batch, 2, tokens), 1, dtype=torch.long)
    assignment[:, :, start:end] = 0
    return Clusters(assignment, 1)


def test_page_bound_is_at_least_every_logit_in_its_page():
    keys, _, _, decode = make_inputs(batch=2, kv_heads=2, group=3, tokens=203, queries=5, seed=1)
    selector = QuestSelector(QuestConfig(page_size=16))
    index = selector.build(keys, None, _region(2, 203, 7, 180))
    query = group_queries(decode, 2, shared=False)
    scores = selector.score(query, index, keys, 0.2)
    logits = OracleSelector().score(query, None, keys, 0.2)
    paged = torch.arange(203) >= 7
    assert bool((scores[..., paged] >= logits[..., paged] - 1e-5).all())
    assert bool((scores[..., ~paged] == -math.inf).all())
    # The bound is attained by a key only when it holds every coordinate's extreme; pages of one token are exact.
    single = QuestSelector(QuestConfig(page_size=1))
    exact = single.score(query, single.build(keys, None, _region(2, 203, 7, 180)), keys, 0.2)
    assert torch.allclose(exact[..., paged], logits[..., paged], atol=1e-5)
    # Tokens of one page share one score, different pages differ.
    page = (torch.arange(203) - 7) // 16
    same = page[7:, None] == page[None, 7:]
    equal = scores[0, 0, 0, 0, 7:, None] == scores[0, 0, 0, 0, None, 7:]
    assert torch.equal(equal, same)


def test_extend_matches_building_on_all_keys():
    keys = make_inputs(batch=2, kv_heads=2, tokens=150, seed=2)[0]
    selector = QuestSelector(QuestConfig(page_size=16))
    clusters = _region(2, 100, 4, 90)
    whole = selector.extend(selector.build(keys[:, :, :100], None, clusters), keys[:, :, 100:])
    parts = selector.extend(
        selector.extend(selector.build(keys[:, :, :100], None, clusters), keys[:, :, 100:103]), keys[:, :, 103:]
    )
    for grown in (whole, parts):
        # Pages start at position 4: page j holds positions [4 + 16j, 20 + 16j).
        for j in range(grown.page_min.shape[2]):
            rows = keys[:, :, 4 + 16 * j : 20 + 16 * j]
            assert torch.equal(grown.page_min[:, :, j], rows.amin(2))
            assert torch.equal(grown.page_max[:, :, j], rows.amax(2))
        assert grown.num_tokens == 150 and grown.page_min.shape[2] == math.ceil(146 / 16)


def test_selection_is_whole_pages_with_global_allocation():
    keys, values, prefill, decode = make_inputs(batch=2, kv_heads=2, group=2, tokens=400, queries=3, seed=3)
    pipe = oa.build(
        {
            "clusterer": {"name": "position", "num_blocks": 8},
            "selector": {"name": "quest", "page_size": 8},
            "allocator": "global",
            "tail": "discard",
            "sink": 4,
            "local": 16,
            "budget": {"tokens": 84},
        }
    )
    state = pipe.prepare(keys, values, prefill)
    index = pipe.explain(decode, state).selection.index  # [B, Hkv, g, T, K]
    selected = index[..., 20:]  # after the 4 sink and 16 local rows: 64 selected rows
    page = (selected - 4) // 8  # pages of 8 from position 4; the region ends at 384, so the last page holds 4
    size = torch.full((48,), 8)
    size[-1] = 4
    for row in page.reshape(-1, 64):
        pages, counts = row.unique(return_counts=True)
        assert int((counts < size[pages]).sum()) <= 1  # whole pages, at most one cut by the budget


def test_a_left_padded_row_pages_its_tokens_as_alone():
    keys, values, prefill, decode = make_inputs(batch=1, kv_heads=2, group=3, tokens=200, queries=2, seed=4)
    pad = 13
    padded = [torch.cat([torch.randn(1, 2, pad, t.shape[-1]), t], 2) for t in (keys, values)]
    mask = torch.ones(1, 200 + pad, dtype=torch.bool)
    mask[:, :pad] = False
    pipe = oa.build(
        {
            "clusterer": {"name": "position", "num_blocks": 8},
            "selector": "quest",
            "allocator": "global",
            "tail": "discard",
            "sink": 4,
            "local": 16,
            "budget": {"tokens": 60},
            "kernel": "torch",
        }
    )
    alone = pipe.attend(decode, pipe.prepare(keys, values, prefill))
    shifted = pipe.attend(decode, pipe.prepare(*padded, prefill, mask=mask))
    assert torch.allclose(alone, shifted, atol=1e-6)
