import pytest
import torch

from oa_core.components import Clusters, group_queries
from oa_core.testing import references
from oa_plugins.selectors.oracle import OracleSelector
from oa_plugins.selectors.qgs import QGSConfig, QuerySubspaceSelector, quantize


def _everywhere(batch, heads, tokens):
    return Clusters(torch.zeros(batch, heads, tokens, dtype=torch.long), 1)


def test_int8_codes_round_trip_within_half_a_step():
    projected = torch.randn(3, 100, 16) * torch.rand(3, 100, 1) * 10
    codes, scales = quantize(projected)
    assert codes.dtype == torch.int8
    assert ((codes.float() * scales[..., None] - projected).abs() <= scales[..., None] / 2 + 1e-6).all()


def test_scores_equal_exact_logits_for_keys_in_the_query_subspace_up_to_quantisation():
    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 4, generator=gen)).Q  # [D, r]
    keys = torch.randn(1, 2, 200, 4, generator=gen) @ basis.T  # keys live in the subspace
    query = group_queries(torch.randn(1, 6, 3, 32, generator=gen), 2, shared=False)
    selector = QuerySubspaceSelector(QGSConfig(rank=4))
    index = selector.build(keys, None, _everywhere(1, 2, 200))  # no queries: the keys' own subspace
    scores = selector.score(query, index, keys, 0.25)
    exact = OracleSelector().score(query, None, keys, 0.25)
    # |z̃ − z| ≤ s · Σ_r |U_rᵀq|_r · scale/2 per key.
    q_proj = query.reshape(1, 2, 9, 32) @ index.basis
    bound = 0.25 * q_proj.abs().sum(-1, keepdim=True) * index.scales[:, :, None, :] / 2
    assert ((scores - exact).reshape(1, 2, 9, 200).abs() <= bound + 1e-5).all()


def test_extend_matches_building_on_all_keys():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 2, 120, 16, generator=gen)
    queries = torch.randn(2, 4, 30, 16, generator=gen)
    selector = QuerySubspaceSelector(QGSConfig(rank=8, key_rank=0))  # a basis from the queries alone
    whole = selector.build(keys, queries, _everywhere(2, 2, 120))
    grown = selector.extend(selector.build(keys[:, :, :100], queries, _everywhere(2, 2, 100)), keys[:, :, 100:])
    assert torch.equal(whole.codes, grown.codes) and torch.allclose(whole.scales, grown.scales)
    # With a key rank the basis depends on the keys prepare saw; later keys are coded in that basis.
    selector = QuerySubspaceSelector(QGSConfig(rank=8, key_rank=4))
    first = selector.build(keys[:, :, :100], queries, _everywhere(2, 2, 100))
    grown = selector.extend(first, keys[:, :, 100:])
    codes, scales = quantize(keys[:, :, 100:] @ first.basis)
    assert torch.equal(grown.basis, first.basis) and torch.equal(grown.codes[:, :, 100:], codes)
    assert torch.allclose(grown.scales[:, :, 100:], scales)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per head"])
@pytest.mark.parametrize("T", [1, 3])
def test_the_fused_scores_match_the_torch_path(shared, T, monkeypatch):
    """The Triton kernel (under the interpreter) takes each selection head's maximum before the positive factor
    s·scale_i; the torch path scales first: the same scores."""
    pytest.importorskip("triton")
    from oa_plugins.selectors import qgs

    gen = torch.Generator().manual_seed(2)
    B, Hkv, g, N, D, r = 2, 2, 3, 1000, 32, 16  # N: not a multiple of the block
    keys = torch.randn(B, Hkv, N, D, generator=gen)
    query = group_queries(torch.randn(B, Hkv * g, T, D, generator=gen), Hkv, shared)
    selector = QuerySubspaceSelector(QGSConfig(rank=r))
    index = selector.build(keys, torch.randn(B, Hkv * g, 40, D, generator=gen), _everywhere(B, Hkv, N))
    launches = []
    kernel = qgs.group_int8_scores
    monkeypatch.setattr(qgs, "group_int8_scores", lambda *a, **k: launches.append(1) or kernel(*a, **k))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused = selector.score(query, index, keys, 0.125)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reference = selector.score(query, index, keys, 0.125)
    assert launches == [1]  # the first call took the fused kernel, the second the torch path
    assert fused.shape == reference.shape == (B, Hkv, 1 if shared else g, T, N)
    assert fused.dtype == torch.float32
    assert torch.allclose(fused, reference, rtol=1e-5, atol=1e-5)


def test_the_fused_scores_take_odd_ranks_and_small_blocks():
    pytest.importorskip("triton")
    from oa_plugins.selectors.qgs import group_int8_scores

    gen = torch.Generator().manual_seed(3)
    B, Hkv, g, T, N, r = 2, 3, 2, 2, 77, 12  # r: not a power of two
    codes, scales = quantize(torch.randn(B, Hkv, N, r, generator=gen) * 2)
    projected = torch.randn(B, Hkv, g * T, r, generator=gen)
    fused = group_int8_scores(projected, codes, scales, 0.5, T, 1, block_n=32)
    reference = (projected @ codes.float().transpose(-1, -2)) * (0.5 * scales[:, :, None, :])
    assert torch.allclose(fused, reference.view(B, Hkv, g, T, N), rtol=1e-5, atol=1e-5)


def test_the_fused_scores_write_into_a_given_buffer_or_refuse_it():
    pytest.importorskip("triton")
    from oa_plugins.selectors.qgs import group_int8_scores

    gen = torch.Generator().manual_seed(4)
    codes, scales = quantize(torch.randn(1, 2, 40, 16, generator=gen))
    projected = torch.randn(1, 2, 4, 16, generator=gen)
    expected = group_int8_scores(projected, codes, scales, 0.5, 1, 2)
    out = torch.full((2 * 2, 40), float("nan"))  # the fused step's [rows, capacity] view of the same elements
    assert group_int8_scores(projected, codes, scales, 0.5, 1, 2, out=out) is out
    assert torch.equal(out.view_as(expected), expected)
    with pytest.raises(ValueError, match=r"out: a contiguous float32 tensor of 160 elements, got torch.float16"):
        group_int8_scores(projected, codes, scales, 0.5, 1, 2, out=out.half())
    with pytest.raises(ValueError, match="of 160 elements"):
        group_int8_scores(projected, codes, scales, 0.5, 1, 2, out=out[:, :20])


def test_group_scores_reject_query_rows_that_do_not_form_the_groups():
    pytest.importorskip("triton")
    from oa_plugins.selectors.qgs import group_int8_scores

    codes, scales = quantize(torch.randn(1, 1, 20, 16))
    with pytest.raises(ValueError, match="5 rows is not a multiple of group 2 × queries 1"):
        group_int8_scores(torch.randn(1, 1, 5, 16), codes, scales, 0.5, 1, 2)


@pytest.mark.parametrize("interpret", ["0", "1"], ids=["torch path", "triton path"])
@pytest.mark.parametrize("shared", [False, True], ids=["per head", "shared"])
def test_scores_are_the_projected_logits_within_the_int8_bound(interpret, shared, monkeypatch):
    """Eq. 5 against exact arithmetic (oa_core.testing.references.qgs_error_bound): z̃_i is s·(U_rᵀq)·(U_rᵀk_i) up to the
    int8 rounding of U_rᵀk_i, on the torch path (what a CPU run takes) and on the fused Triton path; a shared
    selection takes the group's maximum. Keys are not confined to the subspace and their norms vary 100-fold."""
    if interpret == "1":
        pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = torch.Generator().manual_seed(6)
    B, Hkv, g, T, N, D, r = 2, 2, 3, 2, 300, 32, 8
    keys = torch.randn(B, Hkv, N, D, generator=gen) * torch.logspace(-1, 1, N).view(1, 1, N, 1)
    decode = torch.randn(B, Hkv * g, T, D, generator=gen)
    selector = QuerySubspaceSelector(QGSConfig(rank=r))
    index = selector.build(keys, torch.randn(B, Hkv * g, 50, D, generator=gen), _everywhere(B, Hkv, N))
    scores = selector.score(group_queries(decode, Hkv, shared), index, keys, 0.3)
    exact, bound = references.qgs_error_bound(decode, keys, index.basis, 0.3)
    exact, bound = (t.view(B, Hkv, g, T, N) for t in (exact, bound))
    if shared:  # |max_j a_j − max_j b_j| ≤ max_j |a_j − b_j|
        exact, bound = exact.amax(2, keepdim=True), bound.amax(2, keepdim=True)
    assert scores.shape == exact.shape
    assert ((scores.double() - exact).abs() <= bound + 1e-5).all()
    assert (bound < 0.05 * exact.abs().amax(-1, keepdim=True)).all()  # the bound is tight enough to mean something


def _outlier_case():
    """Keys that spread most in dims 0-3 (where the prefill queries look), little in dims 4-11, and one key (row 50)
    far out along dim 12; a decode query that looks along dim 12 too: what a needle is to Gemma-3 (README, "RULER 16K
    on Gemma-3-270M"). The keys' largest spread lies inside the query subspace, the outlier's outside it."""
    gen = torch.Generator().manual_seed(4)
    keys = torch.zeros(1, 1, 256, 16)
    keys[..., :12] = 0.1 * torch.randn(1, 1, 256, 12, generator=gen)
    keys[..., :4] *= 30
    keys[0, 0, 50, 12] = 10.0
    prefill = torch.zeros(1, 2, 64, 16)
    prefill[..., :4] = torch.randn(1, 2, 64, 4, generator=gen)
    decode = torch.zeros(1, 2, 1, 16)
    decode[..., :4] = torch.randn(1, 2, 1, 4, generator=gen)
    decode[..., 12] = 10.0
    return keys, prefill, decode


def test_the_key_rank_spans_the_keys_spread_outside_the_query_subspace():
    from oa_core.ops.geometry import query_geometry, with_key_spread

    keys, prefill, _ = _outlier_case()
    region = torch.ones(1, 256, dtype=torch.bool)
    basis, _ = query_geometry(keys, prefill, region, 4, 64)
    extended = with_key_spread(basis, keys, region, 2)
    assert extended.shape == (1, 1, 16, 6)
    assert torch.allclose(extended[0, 0].T @ extended[0, 0], torch.eye(6), atol=1e-5)  # orthonormal
    inside = extended[0, 0] @ extended[0, 0].T
    assert torch.allclose(inside @ basis[0, 0], basis[0, 0], atol=1e-5)  # the query subspace is kept
    assert inside[12, 12] > 0.99  # the outlier's direction is added
    assert QGSConfig(rank=16, key_rank=15).key_rank == 15
    # The default: half the rank from the keys (the spec then states it resolved); 0 where the rank is 1.
    assert [QGSConfig(rank=r).key_rank for r in (16, 64, 5, 1)] == [8, 32, 2, 0]
    with pytest.raises(ValueError, match=r"key_rank \(16\) must be below rank \(16\)"):
        QGSConfig(rank=16, key_rank=16)


@pytest.mark.parametrize("rank, key_rank, found", [(4, 0, False), (6, 2, True)])
def test_a_key_outside_the_query_subspace_is_selected_with_a_key_rank(rank, key_rank, found):
    """The queries span 4 dimensions: rank 4 is their whole subspace, and 2 more from the keys reach the outlier."""
    import oa_core as oa

    keys, prefill, decode = _outlier_case()
    pipe = oa.build(
        {
            "clusterer": {"name": "qgc", "num_clusters": 4, "rank": 4},
            "kernel": "torch",
            "selector": {"name": "qgs", "rank": rank, "key_rank": key_rank, "rerank": 0},
            "allocator": "global",
            "tail": "discard",
            "budget": {"tokens": 20},
            "sink": 4,
            "local": 8,
        }
    )
    state = pipe.prepare(keys, keys.clone(), prefill)
    chosen = pipe.explain(decode, state).selection.index
    assert bool((chosen == 50).any()) is found
