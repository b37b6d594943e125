import dataclasses
import math

import pytest
import torch

import oa_core as oa
from conftest import dense_attention, make_inputs, relative_error
from oa_core import state as state_module

SMALL = {"clusterer": {"name": "qgc", "num_clusters": 16}, "sink": 4, "local": 16}


def run(spec, keys, values, prefill, decode):
    pipe = oa.build(spec)
    return pipe.attend(decode, pipe.prepare(keys, values, prefill), return_stats=True)


@pytest.mark.parametrize("budget", [{"density": 1.0}, {"tokens": 300}, {"tokens": 10_000}])
def test_budget_covering_the_context_is_dense_and_says_so(inputs, budget):
    keys, values, prefill, decode = inputs
    out, stats = run({**SMALL, "budget": budget}, keys, values, prefill, decode)
    assert relative_error(out, dense_attention(decode, keys, values)) < 1e-5
    assert stats.dense and stats.reason.startswith("dense: budget of") and stats.density == 1.0


def test_clusters_of_one_token_give_dense_attention(inputs):
    keys, values, prefill, decode = inputs
    spec = {"clusterer": {"name": "position", "block_size": 1}, "sink": 4, "local": 16, "budget": {"tokens": 28}}
    out, stats = run(spec, keys, values, prefill, decode)
    assert not stats.dense and stats.density == pytest.approx(28 / 300)
    assert int(stats.proxies.min()) == 300 - 20 - 8  # every unread token is its own proxy
    assert relative_error(out, dense_attention(decode, keys, values)) < 1e-5


def oracle_topk(decode, keys, values, sink, local, budget, shared):
    """Attention over sink ∪ local ∪ the top (budget − sink − local) exact logits of the middle, computed directly."""
    group = decode.shape[1] // keys.shape[1]
    n = keys.shape[2]
    logits = decode.double() @ keys.double().repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(keys.shape[-1])
    middle = logits[..., sink : n - local]
    if shared:
        b, h, t, m = middle.shape
        middle = middle.view(b, h // group, group, t, m).amax(2, keepdim=True).expand(-1, -1, group, -1, -1)
        middle = middle.reshape(b, h, t, m)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[..., :sink] = True
    keep[..., n - local :] = True
    keep[..., sink : n - local].scatter_(-1, middle.topk(budget - sink - local, dim=-1).indices, True)
    weights = torch.softmax(logits.masked_fill(~keep, -math.inf), dim=-1)
    return weights @ values.double().repeat_interleave(group, 1)


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_discard_with_oracle_selection_and_global_allocation_is_oracle_topk(inputs, gqa):
    keys, values, prefill, decode = inputs
    spec = {
        **SMALL,
        "selector": "oracle",
        "allocator": "global",
        "tail": "discard",
        "budget": {"tokens": 60},
        "gqa": gqa,
    }
    out, stats = run(spec, keys, values, prefill, decode)
    expected = oracle_topk(decode, keys, values, 4, 16, 60, shared=gqa == "shared")
    assert relative_error(out, expected) < 1e-5
    assert int(stats.reads.min()) == int(stats.reads.max()) == 60


@pytest.mark.parametrize("tail", ["proxy", "discard", "sample"])
@pytest.mark.parametrize("gqa", ["per_head", "shared"])
@pytest.mark.parametrize("density", [0.1, 0.25, 0.5])
def test_measured_density_stays_within_the_budget(inputs, tail, gqa, density):
    keys, values, prefill, decode = inputs
    out, stats = run({**SMALL, "tail": tail, "gqa": gqa, "budget": {"density": density}}, keys, values, prefill, decode)
    budget = math.floor(density * 300)
    assert int(stats.reads.max()) <= budget and stats.density <= budget / 300
    assert int(stats.reads.min()) == budget  # the whole budget is spent: Σ q_b = E_sel
    assert stats.reads.shape == (2, 2, 3 if gqa == "per_head" else 1, 2)
    assert torch.isfinite(out).all()


def test_proxies_beat_discarding_on_clustered_keys(inputs):
    keys, values, prefill, decode = inputs
    dense = dense_attention(decode, keys, values)
    errors = {
        tail: relative_error(
            run({**SMALL, "tail": tail, "budget": {"density": 0.12}}, keys, values, prefill, decode)[0], dense
        )
        for tail in ("proxy", "discard")
    }
    assert errors["proxy"] < errors["discard"]


@pytest.mark.parametrize("group", [3, 4])
@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_gqa_batch_rows_are_independent(group, gqa):
    keys, values, prefill, decode = make_inputs(batch=3, kv_heads=2, group=group, seed=group)
    spec = {**SMALL, "gqa": gqa, "budget": {"density": 0.2}}
    out, _ = run(spec, keys, values, prefill, decode)
    assert out.shape == decode.shape
    for row in range(3):
        alone, _ = run(spec, *(t[row : row + 1] for t in (keys, values, prefill, decode)))
        assert relative_error(out[row : row + 1], alone) < 1e-5


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_half_precision_inputs_match_float32_on_the_same_values(dtype, tolerance):
    low = make_inputs(dtype=dtype, seed=3)
    spec = {**SMALL, "budget": {"density": 0.2}}
    out, stats = run(spec, *low)
    reference, _ = run(spec, *(t.float() for t in low))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert relative_error(out, reference) < tolerance


def test_results_are_deterministic_for_a_fixed_seed(inputs):
    spec = {**SMALL, "budget": {"density": 0.2}, "tail": "sample"}
    first, _ = run(spec, *inputs)
    again, _ = run(spec, *inputs)
    assert torch.equal(first, again)
    other, _ = run({**spec, "seed": 1}, *inputs)
    assert not torch.equal(first, other)


def test_custom_scale_is_used(inputs):
    keys, values, prefill, decode = inputs
    pipe = oa.build({**SMALL, "budget": {"density": 1.0}})
    out = pipe.attend(decode, pipe.prepare(keys, values, prefill, scale=0.05))
    assert relative_error(out, dense_attention(decode, keys, values, scale=0.05)) < 1e-5


def test_append_pools_tokens_leaving_the_local_window():
    keys, values, prefill, decode = make_inputs(tokens=340, seed=5)
    pipe = oa.build({**SMALL, "budget": {"tokens": 40}})
    state = pipe.prepare(keys[:, :, :300], values[:, :, :300], prefill)
    for start in range(300, 340, 8):  # grow in steps, as decoding does
        state.append(keys[:, :, start : start + 8], values[:, :, start : start + 8])
    assert state.num_tokens == 340 and state.clustered_end == 340 - 16
    assignment = state.pooled.assignment
    clustered = assignment < state.num_clusters
    assert clustered[..., 4:324].all() and not clustered[..., :4].any() and not clustered[..., 324:].any()
    # The pooled sums are exactly the sums over each cluster's current members.
    one_hot = torch.nn.functional.one_hot(assignment, state.num_clusters + 1)[..., :-1].float()
    assert torch.allclose(state.pooled.count, one_hot.sum(2))
    assert torch.allclose(state.pooled.key_sum, one_hot.transpose(-1, -2) @ keys.float(), atol=1e-4)
    assert torch.allclose(state.pooled.value_sum, one_hot.transpose(-1, -2) @ values.float(), atol=1e-4)
    out, stats = pipe.attend(decode, state, return_stats=True)
    assert stats.num_tokens == 340 and int(stats.reads.max()) == 40
    # A dense state attends to the appended rows too.
    dense = oa.build({**SMALL, "budget": {"density": 1.0}})
    state = dense.prepare(keys[:, :, :300], values[:, :, :300], prefill)
    state.append(keys[:, :, 300:], values[:, :, 300:])
    assert relative_error(dense.attend(decode, state), dense_attention(decode, keys, values)) < 1e-5


def test_grow_to_follows_the_cache_in_place_like_append():
    keys, values, prefill, decode = make_inputs(tokens=340, seed=5)
    pipe = oa.build({**SMALL, "budget": {"tokens": 40}})
    appended = pipe.prepare(keys[:, :, :300], values[:, :, :300], prefill)
    grown = appended.fork()
    for end in range(308, 348, 8):  # a cache that grows by itself, e.g. transformers' (views of it here)
        appended.append(keys[:, :, end - 8 : end], values[:, :, end - 8 : end])
        grown.grow_to(keys[:, :, :end], values[:, :, :end])
    assert grown.keys.data_ptr() == keys.data_ptr() and grown.values.data_ptr() == values.data_ptr()  # no copy
    assert appended.keys.data_ptr() != keys.data_ptr()
    assert torch.equal(grown.pooled.assignment, appended.pooled.assignment)
    assert torch.equal(grown.pooled.key_sum, appended.pooled.key_sum)
    assert torch.equal(pipe.attend(decode, grown), pipe.attend(decode, appended))


def _listed_members(plan):
    """A plan's member table as each cluster's listed positions (the table's width differs with its room to grow)."""
    table, counts = plan.members
    slots = torch.arange(table.shape[-1])
    return counts, [
        table[idx][slots < counts[idx]].tolist()
        for idx in torch.cartesian_prod(*(torch.arange(n) for n in counts.shape)).tolist()
        for idx in [tuple(idx)]
    ]


@pytest.mark.parametrize("budget", [{"density": 0.3}, {"tokens": 40}])
def test_growth_updates_the_plan_as_a_fresh_one_would_be(budget, monkeypatch):
    # Without sorting the context again: the positions read every step, the budget's split, the member lists,
    # through a table that fills up (2 clusters), in a left-padded batch with a dense row.
    monkeypatch.setattr(state_module, "MEMBER_ROOM", 2)  # the table fills up: checked, then built anew
    keys, values, prefill, decode = make_inputs(batch=1, tokens=330, seed=8)
    rows = [
        (keys[:, :, :300], values[:, :, :300]),
        (keys[:, :, :250], values[:, :, :250]),
        (keys[:, :, :18], values[:, :, :18]),
    ]  # the last is read densely (shorter than sink + local)
    cache_keys, mask = left_pad([k for k, _ in rows])
    cache_values, _ = left_pad([v for _, v in rows])
    pipe = oa.build({**SMALL, "clusterer": {"name": "qgc", "num_clusters": 2}, "budget": budget})
    state = pipe.prepare(cache_keys, cache_values, prefill.expand(3, -1, -1, -1), mask=mask)
    assert bool(state.dense_rows[2]) and not bool(state.dense_rows[:2].any())
    state.plan()
    extra_keys, extra_values = keys[:, :, 300:].expand(3, -1, -1, -1), values[:, :, 300:].expand(3, -1, -1, -1)
    for start, step in [(0, 1), (1, 3), (4, 1), (5, 25)]:
        state.append(extra_keys[:, :, start : start + step], extra_values[:, :, start : start + step])
        grown, fresh = state.plan(), dataclasses.replace(state, _plan=None).plan()
        assert torch.equal(grown.fixed, fresh.fixed) and torch.equal(grown.unclustered, fresh.unclustered)
        assert torch.equal(grown.selectable, fresh.selectable) and grown.max_selectable == fresh.max_selectable
        counts, listed = _listed_members(grown)
        assert torch.equal(counts, fresh.members[1]) and listed == _listed_members(fresh)[1]
        assert grown.largest_bound >= int(counts.max())
    assert torch.equal(
        pipe.attend(decode.expand(3, -1, -1, -1), state),
        pipe.attend(decode.expand(3, -1, -1, -1), dataclasses.replace(state, _plan=None)),
    )


def left_pad(rows):
    """Left-pad a list of [1, H, n_i, D] tensors to one batch with wild values in the padding, and the mask."""
    n = max(r.shape[2] for r in rows)
    batch = torch.full((len(rows), rows[0].shape[1], n, rows[0].shape[3]), 1e4)
    mask = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        batch[i, :, n - r.shape[2] :] = r[0]
        mask[i, n - r.shape[2] :] = True
    return batch, mask


# (tail: sample is left out: its random draws are laid out over positions, which padding shifts.)
@pytest.mark.parametrize(
    "spec", [{}, {"gqa": "shared"}, {"selector": "oracle", "allocator": "global", "tail": "discard"}]
)
def test_a_left_padded_row_matches_the_row_alone(spec):
    short = make_inputs(batch=1, tokens=220, seed=8)
    long = make_inputs(batch=1, tokens=300, seed=9)
    keys, mask = left_pad([short[0], long[0]])
    values, _ = left_pad([short[1], long[1]])
    prefill, decode = torch.cat([short[2], long[2]]), torch.cat([short[3], long[3]])
    spec = {**SMALL, **spec, "budget": {"density": 0.15}}
    pipe = oa.build(spec)
    state = pipe.prepare(keys, values, prefill, mask=mask)
    assert (state.pooled.assignment[0, :, :80] == state.num_clusters).all()  # padding is never clustered
    out, stats = pipe.attend(decode, state, return_stats=True)
    for row, alone in enumerate((short, long)):
        expected, alone_stats = run(spec, *alone)
        assert relative_error(out[row : row + 1], expected) < 1e-4
        assert torch.equal(stats.reads[row], alone_stats.reads[0])  # 15% of each row's own length
    assert torch.isfinite(out).all()  # the 1e4 padding is never read


def test_rows_whose_budget_covers_them_are_read_in_full():
    short = make_inputs(batch=1, tokens=40, seed=10)
    long = make_inputs(batch=1, tokens=300, seed=11)
    keys, mask = left_pad([short[0], long[0]])
    values, _ = left_pad([short[1], long[1]])
    prefill, decode = torch.cat([short[2], long[2]]), torch.cat([short[3], long[3]])
    pipe = oa.build({**SMALL, "budget": {"tokens": 60}})
    state = pipe.prepare(keys, values, prefill, mask=mask)
    out, stats = pipe.attend(decode, state, return_stats=True)
    assert state.dense_rows.tolist() == [True, False]
    assert stats.reason == "sparse: proxy tail; 1 of 2 rows dense (budget >= context)"
    assert (
        relative_error(
            out[:1],
            dense_attention(
                *(t[:, :, -40:] if t.dim() == 4 and t is not decode else t for t in (decode[:1], keys[:1], values[:1]))
            ),
        )
        < 1e-5
    )
    assert (stats.reads[0] == 40).all() and (stats.reads[1] == 60).all()
    state.append(keys[:, :, -20:], values[:, :, -20:])  # the dense row stays exact as it grows
    assert (state.pooled.assignment[0] == state.num_clusters).all()


def test_causal_queries_never_see_later_positions():
    keys, values, prefill, decode = make_inputs(tokens=310, seed=12)
    pipe = oa.build({**SMALL, "budget": {"density": 0.2}})
    queries = keys[:, torch.arange(6) // 3, 300:] * 0.5  # the 10 new tokens query the cache, causally
    outputs = []
    for last_value in (values[:, :, -1:], values[:, :, -1:] + 10):  # change only the newest row
        state = pipe.prepare(keys[:, :, :300], values[:, :, :300], prefill)
        state.append(keys[:, :, 300:], torch.cat([values[:, :, 300:-1], last_value], dim=2))
        outputs.append(pipe.attend(queries, state, causal=True))
    assert torch.equal(outputs[0][:, :, :-1], outputs[1][:, :, :-1])  # the first 9 queries don't see it
    assert not torch.allclose(outputs[0][:, :, -1], outputs[1][:, :, -1])  # the last one does
    # Without the mask every query would have seen it.
    state = pipe.prepare(keys[:, :, :300], values[:, :, :300], prefill)
    state.append(keys[:, :, 300:], values[:, :, 300:])
    assert not torch.allclose(pipe.attend(queries, state)[:, :, 0], outputs[0][:, :, 0])


def test_causal_block_longer_than_the_local_window_is_refused(inputs):
    keys, values, prefill, decode = inputs
    pipe = oa.build({**SMALL, "budget": {"density": 0.2}})
    state = pipe.prepare(keys, values, prefill)
    with pytest.raises(ValueError, match="17 causal queries do not fit the local window of 16"):
        pipe.attend(keys[:, torch.arange(6) // 3, -17:], state, causal=True)


def test_causal_dense_state_is_causal_attention():
    keys, values, prefill, _ = make_inputs(tokens=120, seed=13)
    pipe = oa.build({**SMALL, "budget": {"density": 1.0}})
    queries = keys[:, torch.arange(6) // 3, -8:] * 0.5
    out, stats = pipe.attend(queries, pipe.prepare(keys, values, prefill), return_stats=True, causal=True)
    allowed = torch.ones(8, 120, dtype=torch.bool).tril(diagonal=112)
    expected = torch.nn.functional.scaled_dot_product_attention(
        queries.double(),
        keys.double().repeat_interleave(3, 1),
        values.double().repeat_interleave(3, 1),
        attn_mask=allowed,
    )
    assert stats.dense and relative_error(out, expected) < 1e-5


def _grown_state(spec, tokens=240, grown=40, seed=4):
    """A state prepared on the first ``tokens − grown`` rows, then grown by ``grown`` (so some of them leave the
    local window and join clusters), with the full inputs."""
    keys, values, prefill, decode = make_inputs(tokens=tokens, seed=seed)
    pipe = oa.build({"kernel": "torch", **spec})
    state = pipe.prepare(keys[:, :, :-grown], values[:, :, :-grown], prefill)
    state.append(keys[:, :, -grown:], values[:, :, -grown:])
    return pipe, state, keys, values, decode


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_output_is_eq1_over_the_top_exact_logits_and_the_states_clusters_after_growth(gqa):
    """The whole attend against the float64 reference of Eq. 1: with the oracle selector and global allocation the
    exact set is sink ∪ local ∪ the best E − sink − local logits among the clustered rows (found here directly), and
    every cluster's unread tail gets one count-aware proxy — including rows that joined by growth."""
    from oa_core.testing import references

    budget, sink, local = 60, 4, 16
    spec = {**SMALL, "selector": "oracle", "allocator": "global", "budget": {"tokens": budget}, "gqa": gqa}
    pipe, state, keys, values, decode = _grown_state(spec)
    B, Hkv, N, D = keys.shape
    Hq, T = decode.shape[1:3]
    g = Hq // Hkv
    assignment, C = state.pooled.assignment, state.num_clusters
    assert (assignment[..., sink : N - local] < C).all() and (assignment[..., N - local :] == C).all()
    logits = decode.double().view(B, Hkv, g, T, D) @ keys.double().transpose(-1, -2)[:, :, None] / math.sqrt(D)
    if gqa == "shared":
        logits = logits.amax(2, keepdim=True)
    logits = logits.masked_fill((assignment == C)[:, :, None, None], -math.inf)
    top = logits.topk(budget - sink - local, dim=-1).indices
    fixed = torch.cat([torch.arange(sink), torch.arange(N - local, N)]).expand(*top.shape[:4], -1)
    expected = references.proxy_attention(
        decode, keys, values, torch.cat([fixed, top], -1), assignment, C, 1 / math.sqrt(D)
    )
    assert relative_error(pipe.attend(decode, state), expected) < 1e-5


def test_allocators_see_each_clusters_own_statistics_after_growth():
    """z̄_b and σ̂_b² from the state's pooled sums (what every allocator gets) equal those of each cluster's members,
    computed from the keys themselves (oa_core.testing.references.cluster_logit_stats), after rows joined by growth."""
    from oa_core.ops.cluster_stats import cluster_logit_stats
    from oa_core.testing import references

    pipe, state, keys, values, decode = _grown_state({**SMALL, "budget": {"tokens": 60}})
    got = cluster_logit_stats(decode, *state.cluster_moments(), state.scale)
    expected = references.cluster_logit_stats(decode, keys, state.pooled.assignment, state.num_clusters, state.scale)
    for a, b in zip(got, expected):
        assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-4)
