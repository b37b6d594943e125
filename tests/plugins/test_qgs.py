import torch

from oa_core.components import Clusters
from oa_plugins.selectors.oracle import OracleSelector
from oa_plugins.selectors.qgs import QGSConfig, QuerySubspaceSelector, quantize


def test_int8_codes_round_trip_within_half_a_step():
    projected = torch.randn(3, 100, 16) * torch.rand(3, 100, 1) * 10
    codes, scales = quantize(projected)
    assert codes.dtype == torch.int8
    assert ((codes.float() * scales[..., None] - projected).abs() <= scales[..., None] / 2 + 1e-6).all()


def test_scores_equal_exact_logits_for_keys_in_the_query_subspace_up_to_quantisation():
    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 4, generator=gen)).Q  # [D, r]
    keys = (torch.randn(1, 2, 200, 4, generator=gen) @ basis.T)  # keys live in the subspace
    query = torch.randn(1, 6, 3, 32, generator=gen)
    clusters = Clusters(torch.zeros(1, 2, 200, dtype=torch.long), 1, basis=basis.expand(1, 2, 32, 4))
    selector = QuerySubspaceSelector(QGSConfig(rank=4))
    index = selector.build(keys, None, clusters)
    scores = selector.score(query, index, keys, 0.25)
    exact = OracleSelector().score(query, None, keys, 0.25)
    # |z̃ − z| ≤ s · Σ_r |U_rᵀq|_r · scale/2 per key.
    q_proj = query.reshape(1, 2, 9, 32) @ basis
    bound = 0.25 * q_proj.abs().sum(-1, keepdim=True) * index.scales[:, :, None, :] / 2
    assert ((scores - exact).reshape(1, 2, 9, 200).abs() <= bound + 1e-5).all()


def test_extend_matches_building_on_all_keys():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 2, 120, 16, generator=gen)
    queries = torch.randn(2, 4, 30, 16, generator=gen)
    selector = QuerySubspaceSelector(QGSConfig(rank=8))
    clusters = Clusters(torch.zeros(2, 2, 100, dtype=torch.long), 1)
    whole = selector.build(keys, queries, clusters)
    grown = selector.extend(selector.build(keys[:, :, :100], queries, clusters), keys[:, :, 100:])
    assert torch.equal(whole.codes, grown.codes) and torch.allclose(whole.scales, grown.scales)
