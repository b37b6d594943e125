import pytest
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


def _reference_group_scores(selector, query, index, keys, scale, shared, outside):
    """score() per query head, then the group maximum and the mask, in torch."""
    B, Hq, T, _ = query.shape
    Hkv = keys.shape[1]
    scores = selector.score(query, index, keys, scale).view(B, Hkv, Hq // Hkv, T, -1)
    scores = scores.amax(dim=2, keepdim=True) if shared else scores
    return scores if outside is None else scores.masked_fill(outside, float("-inf"))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per head"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "outside"])
def test_fused_group_scores_match_the_reference(shared, T, masked, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(2)
    B, Hkv, g, N, D, r = 2, 2, 3, 1000, 32, 16  # N: not a multiple of the block
    keys = torch.randn(B, Hkv, N, D, generator=gen)
    query = torch.randn(B, Hkv * g, T, D, generator=gen)
    selector = QuerySubspaceSelector(QGSConfig(rank=r))
    index = selector.build(keys, torch.randn(B, Hkv * g, 40, D, generator=gen),
                           Clusters(torch.zeros(B, Hkv, N, dtype=torch.long), 1))
    outside = None
    if masked:
        outside = torch.rand(B, Hkv, 1, 1, N, generator=gen) < 0.2
        outside[..., :4] = True  # sink
        outside[..., -16:] = True  # local window
    from oa_plugins.selectors import qgs

    launches = []
    kernel = qgs.group_int8_scores
    monkeypatch.setattr(qgs, "group_int8_scores", lambda *a, **k: launches.append(1) or kernel(*a, **k))
    fused = selector.group_scores(query, index, keys, 0.125, shared, outside=outside)
    assert launches == [1]  # the fused kernel, not the torch path
    reference = _reference_group_scores(selector, query, index, keys, 0.125, shared, outside)
    assert fused.shape == reference.shape == (B, Hkv, 1 if shared else g, T, N)
    assert fused.dtype == torch.float32
    if outside is not None:
        assert torch.equal(fused == float("-inf"), outside.expand_as(fused))
    assert torch.allclose(fused, reference, rtol=1e-5, atol=1e-5)


def test_fused_group_scores_take_any_broadcastable_mask_and_odd_ranks(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from oa_plugins.selectors.qgs import group_int8_scores

    gen = torch.Generator().manual_seed(3)
    B, Hkv, g, T, N, r = 2, 3, 2, 2, 77, 12  # r: not a power of two
    codes, scales = quantize(torch.randn(B, Hkv, N, r, generator=gen) * 2)
    projected = torch.randn(B, Hkv, g * T, r, generator=gen)
    outside = torch.rand(B, 1, g, T, N, generator=gen) < 0.3  # per head and query, shared over KV heads
    fused = group_int8_scores(projected, codes, scales, 0.5, T, 1, outside, block_n=32)
    reference = (projected @ codes.float().transpose(-1, -2)) * (0.5 * scales[:, :, None, :])
    reference = reference.view(B, Hkv, g, T, N).masked_fill(outside, float("-inf"))
    assert torch.allclose(fused, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused == float("-inf"), outside.expand_as(fused))


def test_group_scores_without_the_interpreter_use_the_torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(1, 2, 50, 16, generator=gen)
    query = torch.randn(1, 4, 1, 16, generator=gen)
    selector = QuerySubspaceSelector(QGSConfig(rank=8))
    index = selector.build(keys, query, Clusters(torch.zeros(1, 2, 50, dtype=torch.long), 1))
    outside = torch.zeros(1, 2, 1, 1, 50, dtype=torch.bool)
    outside[..., :3] = True
    scores = selector.group_scores(query, index, keys, 0.25, True, outside=outside)
    reference = _reference_group_scores(selector, query, index, keys, 0.25, True, outside)
    assert torch.equal(scores, reference)


def test_group_scores_reject_query_rows_that_do_not_form_the_groups():
    pytest.importorskip("triton")
    from oa_plugins.selectors.qgs import group_int8_scores

    codes, scales = quantize(torch.randn(1, 1, 20, 16))
    with pytest.raises(ValueError, match="5 rows is not a multiple of group 2 × queries 1"):
        group_int8_scores(torch.randn(1, 1, 5, 16), codes, scales, 0.5, 1, 2)


@pytest.mark.parametrize("interpret", ["0", "1"], ids=["torch path", "triton path"])
@pytest.mark.parametrize("shared", [False, True], ids=["per head", "shared"])
def test_scores_are_the_projected_logits_within_the_int8_bound(interpret, shared, monkeypatch):
    """Eq. 5 against exact arithmetic (oa_core.references.qgs_error_bound): z̃_i is s·(U_rᵀq)·(U_rᵀk_i) up to the
    int8 rounding of U_rᵀk_i, on the torch path (what a CPU run takes) and on the fused Triton path; a shared
    selection takes the group's maximum. Keys are not confined to the subspace and their norms vary 100-fold."""
    from oa_core import references

    if interpret == "1":
        pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = torch.Generator().manual_seed(6)
    B, Hkv, g, T, N, D, r = 2, 2, 3, 2, 300, 32, 8
    keys = torch.randn(B, Hkv, N, D, generator=gen) * torch.logspace(-1, 1, N).view(1, 1, N, 1)
    query = torch.randn(B, Hkv * g, T, D, generator=gen)
    basis = torch.linalg.qr(torch.randn(B, Hkv, D, r, generator=gen)).Q
    clusters = Clusters(torch.zeros(B, Hkv, N, dtype=torch.long), 1, basis=basis)
    selector = QuerySubspaceSelector(QGSConfig(rank=r))
    index = selector.build(keys, None, clusters)
    scores = selector.group_scores(query, index, keys, 0.3, shared)
    exact, bound = references.qgs_error_bound(query, keys, basis, 0.3)
    exact, bound = (t.view(B, Hkv, g, T, N) for t in (exact, bound))
    if shared:  # |max_j a_j − max_j b_j| ≤ max_j |a_j − b_j|
        exact, bound = exact.amax(2, keepdim=True), bound.amax(2, keepdim=True)
    assert scores.shape == exact.shape
    assert ((scores.double() - exact).abs() <= bound + 1e-5).all()
    assert (bound < 0.05 * exact.abs().amax(-1, keepdim=True)).all()  # the bound is tight enough to mean something
