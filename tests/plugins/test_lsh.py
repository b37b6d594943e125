"""SimHash LSH (MagicPIG): the collision rule, its probabilities, and unbiased importance-weighted tail sampling."""

import math

import pytest
import torch
from scipy import stats

import oa_core as oa
from conftest import make_inputs
from oa_core.analysis.metrics import estimator_weights
from oa_core.components import Clusters, group_queries
from oa_plugins.selectors.lsh import LSHConfig, SimHashSelector, log_candidate_probability


def _clusters(batch, heads, tokens):
    return Clusters(torch.zeros(batch, heads, tokens, dtype=torch.long), 1)


def test_candidate_probability_is_the_binomial_tail():
    u = torch.linspace(0.05, 0.99, 30, dtype=torch.float64)
    for K, L, c in ((10, 150, 2), (3, 8, 1), (5, 20, 4), (0, 5, 2)):
        expected = stats.binom.sf(c - 1, L, (u**K).numpy())
        assert torch.allclose(
            log_candidate_probability(u, K, L, c).exp(), torch.from_numpy(expected), rtol=1e-9, atol=1e-300
        )


def test_k_zero_puts_every_token_in_every_bucket():
    keys, values, prefill, decode = make_inputs(batch=2, kv_heads=2, group=3, tokens=120, seed=1)
    selector = SimHashSelector(LSHConfig(K=0, L=4))
    index = selector.build(keys, None, _clusters(2, 2, 120), torch.Generator().manual_seed(0))
    query = group_queries(decode, 2, shared=False)
    pool = selector.sample_pool(query, index, keys, 0.2)
    assert bool((pool == 0).all())  # every token a candidate, with probability 1
    scores = selector.score(query, index, keys, 0.2)
    assert bool((scores == scores[..., :1]).all())  # no token preferred over another
    # So a MagicPIG pipeline with K = 0 is plain uniform sampling over the whole tail: the same draws and weights.
    common = {
        "clusterer": {"name": "position", "num_blocks": 4},
        "allocator": "uniform",
        "tail": "sample",
        "tail_samples": 1.0,
        "sink": 4,
        "local": 16,
        "budget": {"tokens": 50},
        "kernel": "torch",
    }
    lsh = oa.build({**common, "selector": {"name": "lsh", "K": 0, "L": 4}})
    uniform = oa.build({**common, "selector": "oracle"})
    out = [p.attend(decode, p.prepare(keys, values, prefill)) for p in (lsh, uniform)]
    assert torch.equal(out[0], out[1])
    # And with a budget that covers the whole pool, it reads everything: dense attention.
    full = oa.build({**common, "selector": {"name": "lsh", "K": 0, "L": 4}, "budget": {"tokens": 119}})
    state = full.prepare(keys[:, :, :119], values[:, :, :119], prefill)
    w_hat, w = estimator_weights(full, state, decode)
    assert torch.allclose(w_hat, w, rtol=1e-5)


@pytest.mark.parametrize("K, L", [(4, 12), (10, 7), (13, 3)])  # buckets of one byte, two, two with 5 bits over
def test_candidates_collide_in_at_least_min_collisions_tables(K, L):
    keys, _, _, decode = make_inputs(batch=2, kv_heads=2, group=2, tokens=200, seed=2)
    selector = SimHashSelector(LSHConfig(K=K, L=L, min_collisions=2))
    index = selector.build(keys, None, _clusters(2, 2, 200), torch.Generator().manual_seed(3))
    query = group_queries(decode, 2, shared=False)
    collisions, bits_agreeing = selector._collisions(query, index)
    # Recount table by table from the sign bits of the hyperplanes: collisions, and the bits that agree.
    q_bits = decode.float().reshape(2, 2, -1, keys.shape[-1]) @ index.planes > 0
    k_bits = (keys.float() - index.center) @ index.planes > 0
    agree = q_bits.view(2, 2, -1, 1, L, K) == k_bits.view(2, 2, 1, 200, L, K)
    assert torch.equal(collisions, agree.all(-1).sum(-1).float())
    assert torch.equal(bits_agreeing, agree.sum((-1, -2)).float())
    pool = selector.sample_pool(query, index, keys, 0.2).view(2, 2, -1, 200)
    assert torch.equal(pool > -math.inf, collisions >= 2)
    if K == 4:
        assert 0 < int((collisions >= 2).sum()) < collisions.numel()  # a real filter on these inputs


def test_extend_matches_building_on_all_keys():
    keys = make_inputs(batch=2, kv_heads=2, tokens=150, seed=3)[0]
    selector = SimHashSelector(LSHConfig(K=6, L=10))
    region = torch.ones(2, 2, 150, dtype=torch.long)
    region[:, :, :100] = 0  # the centre is the mean of the region: the first 100 keys in both builds
    whole = selector.build(keys, None, Clusters(region, 1), torch.Generator().manual_seed(1))
    grown = selector.extend(
        selector.build(keys[:, :, :100], None, _clusters(2, 2, 100), torch.Generator().manual_seed(1)), keys[:, :, 100:]
    )
    assert torch.allclose(whole.center, grown.center)
    assert torch.equal(whole.buckets, grown.buckets)


def test_shared_selection_cannot_sample_per_head_pools():
    with pytest.raises(oa.SpecError, match=r"gqa: .*lsh.*per_head"):
        oa.build({"selector": "lsh", "tail": "sample", "gqa": "shared"})


def test_importance_weighted_sampling_is_unbiased():
    """E[Ẑ] = Z and E[Σ ŵ_i v_i] = Σ w_i v_i over the random hyperplanes and draws (MagicPIG's estimator): a token
    enters the pool with probability p_i and is weighted by |pool|/m · 1/p_i. Each seed draws new hyperplanes and a
    new subsample (the budget is smaller than a typical pool, so both stages are exercised)."""
    keys, values, prefill, decode = make_inputs(batch=1, kv_heads=1, group=1, tokens=160, dim=8, queries=1, seed=5)
    scale = 0.25
    spec = {
        "clusterer": {"name": "position", "num_blocks": 4},
        "selector": {"name": "lsh", "K": 2, "L": 6},
        "allocator": "uniform",
        "tail": "sample",
        "tail_samples": 1.0,
        "sink": 4,
        "local": 16,
        "budget": {"tokens": 60},
        "kernel": "torch",
    }
    draws = 300
    den, num, pools = [], [], []
    for seed in range(draws):
        pipe = oa.build({**spec, "seed": seed})
        state = pipe.prepare(keys, values, prefill, scale=scale)
        w_hat, w = estimator_weights(pipe, state, decode)
        z = float(w.sum())
        den.append((float(w_hat.sum()) - z) / z)
        num.append(((w_hat - w)[0, 0, 0, 0] @ values[0, 0].double()) / z)
        query = group_queries(decode, 1, shared=False)
        pools.append(int((pipe.selector.sample_pool(query, state.index, keys, scale) > -math.inf).sum()))
    den, num = torch.tensor(den), torch.stack(num)
    pools = torch.tensor(pools, dtype=torch.float64)
    assert float((pools > 40).double().mean()) > 0.2  # the pool often exceeds the 40 samples: subsampling is tested
    se = float(den.std() / math.sqrt(draws))
    assert abs(float(den.mean())) < 3 * se, (float(den.mean()), se)
    assert se < 0.05  # power: a bias of 15% of Z fails
    z_star = float(stats.norm.ppf(1 - 0.00135 / num.shape[1]))  # Bonferroni over the value coordinates
    se_num = num.std(0) / math.sqrt(draws)
    assert bool((num.mean(0).abs() < z_star * se_num).all()), (num.mean(0), se_num)
