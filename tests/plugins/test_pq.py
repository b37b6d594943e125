import pytest
import torch

import oa_core as oa
from oa_core.components import Clusters, group_queries
from oa_plugins.selectors.oracle import OracleSelector
from oa_plugins.selectors.pq import (
    PQSConfig,
    ProductQuantisedSelector,
    pack_codes,
    sub_spaces,
    training_positions,
    unpack_codes,
)


def _everywhere(batch, heads, tokens):
    return Clusters(torch.zeros(batch, heads, tokens, dtype=torch.long), 1)


def _codes(index):
    """The index's codes a sub-space each, ``[B, Hkv, N, M]`` long (4-bit ones are kept two a byte)."""
    M, C = index.centroids.shape[2:4]
    return (unpack_codes(index.codes, M) if C <= 16 else index.codes).long()


def _reconstructed(index):
    """Each key as its codes say: the centroid of its code in every sub-space, ``[B, Hkv, N, D]``."""
    B, Hkv, M, C, dims = index.centroids.shape
    codes = _codes(index).permute(0, 1, 3, 2)  # [B, Hkv, M, N]
    picked = index.centroids.gather(3, codes[..., None].expand(*codes.shape, dims))  # [B, Hkv, M, N, dims]
    return picked.permute(0, 1, 3, 2, 4).reshape(B, Hkv, -1, M * dims)


def _rounding(query, keys, dims, scale):
    """How far the tables' float16 rounding may move a score: 2^-11 of each entry, s·Σ_m |q_m·k_m| for queries
    ``[B, Hkv, ..., T, D]`` over keys (their codes' centroids) ``[B, Hkv, N, D]`` → ``[B, Hkv, ..., T, N]``."""
    split = (-1, dims)
    products = torch.einsum("bh...tmd,bhnmd->bh...tnm", query.unflatten(-1, split), keys.unflatten(-1, split))
    return scale * 2.0**-11 * products.abs().sum(-1)


@pytest.mark.parametrize("bits, tokens", [(8, 200), (4, 16)])
def test_a_sub_space_of_at_most_its_centroids_keys_is_coded_exactly(bits, tokens):
    """With no more keys than 2^bits centroids, every key is a centroid: the scores are the exact logits."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, tokens, 32, generator=gen)
    query = group_queries(torch.randn(2, 6, 2, 32, generator=gen), 2, shared=False)
    selector = ProductQuantisedSelector(PQSConfig(dims=8, bits=bits))
    index = selector.build(keys, None, _everywhere(2, 2, tokens))
    assert index.codes.dtype == torch.uint8 and index.codes.shape == (2, 2, tokens, 4 if bits == 8 else 2)
    assert index.centroids.shape == (2, 2, 4, 2**bits, 8)
    assert torch.allclose(_reconstructed(index), keys)
    exact = OracleSelector().score(query, None, keys, 0.25)
    # The exact logits but for the tables' float16 rounding: at most 2^-11 of each sub-space's |q_m·k_m|.
    rounding = _rounding(query, keys, 8, 0.25).amax(3)  # (the max over a selection head's G heads: 1 here)
    assert ((selector.score(query, index, keys, 0.25) - exact).abs() <= rounding + 1e-5).all()


@pytest.mark.parametrize("interpret", ["0", "1"], ids=["torch path", "triton path"])
@pytest.mark.parametrize("shared, bits", [(False, 4), (True, 8)], ids=["per head, 4 bits", "shared, 8 bits"])
def test_scores_are_the_logits_of_the_centroids_within_their_distance(interpret, shared, bits, monkeypatch):
    """z̃_i = s·Σ_m q_m·c_{m,code}: within s·Σ_m ‖q_m‖·‖k_im − c_{m,code}‖ of s·q·k_i, on the torch path and on the
    Triton kernel (each sub-space's centroid the nearest of the 256). Norms vary 100-fold; N is not a block's
    multiple."""
    if interpret == "1":
        pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = torch.Generator().manual_seed(1)
    B, Hkv, g, T, N, D, dims = 2, 2, 3, 2, 900, 24, 8  # 3 sub-spaces
    keys = torch.randn(B, Hkv, N, D, generator=gen) * torch.logspace(-1, 1, N).view(1, 1, N, 1)
    decode = torch.randn(B, Hkv * g, T, D, generator=gen)
    selector = ProductQuantisedSelector(PQSConfig(dims=dims, bits=bits))
    index = selector.build(keys, None, _everywhere(B, Hkv, N))
    query = group_queries(decode, Hkv, shared)
    scores = selector.score(query, index, keys, 0.3)
    error = keys - _reconstructed(index)  # [B, Hkv, N, D]
    per_head = decode.view(B, Hkv, g, T, D)
    exact = 0.3 * torch.einsum("bhgtd,bhnd->bhgtn", per_head, keys)
    bound = 0.3 * torch.einsum(
        "bhgtm,bhnm->bhgtn",
        per_head.unflatten(-1, (-1, dims)).norm(dim=-1),
        error.unflatten(-1, (-1, dims)).norm(dim=-1),
    )
    # and the tables' float16 rounding
    bound += _rounding(per_head, _reconstructed(index), dims, 0.3)
    if shared:  # |max_j a_j − max_j b_j| ≤ max_j |a_j − b_j|
        exact, bound = exact.amax(2, keepdim=True), bound.amax(2, keepdim=True)
    assert scores.shape == exact.shape == (B, Hkv, 1 if shared else g, T, N)
    assert ((scores - exact).abs() <= bound + 1e-4).all()
    # Each code is its sub-space's nearest centroid.
    points = sub_spaces(keys, dims)  # [B, Hkv, M, N, dims]
    nearest = (points[..., :, None, :] - index.centroids[..., None, :, :]).norm(dim=-1).amin(-1)  # (not cdist's
    # matmul form, whose rounding at these norms is larger than the gaps it would judge)
    chosen = (
        points - index.centroids.gather(3, _codes(index).permute(0, 1, 3, 2)[..., None].expand(*points.shape))
    ).norm(dim=-1)
    assert torch.allclose(chosen, nearest, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_fused_scores_match_the_torch_path(bits, monkeypatch):
    """The kernel takes each selection head's maximum over its G query heads before the positive factor s; odd
    sub-space counts and small blocks."""
    pytest.importorskip("triton")
    from oa_plugins.selectors import pq

    gen = torch.Generator().manual_seed(2)
    B, Hkv, g, T, N, D = 2, 3, 2, 3, 77, 12  # 3 sub-spaces of 4: M not a power of two
    keys = torch.randn(B, Hkv, N, D, generator=gen)
    query = group_queries(torch.randn(B, Hkv * g, T, D, generator=gen), Hkv, shared=True)
    selector = ProductQuantisedSelector(PQSConfig(dims=4, bits=bits))
    index = selector.build(keys, None, _everywhere(B, Hkv, N))
    tables = pq.half_tables(torch.einsum("bhrmd,bhmcd->bhrmc", query.reshape(B, Hkv, g * T, 3, 4), index.centroids))
    fused = pq.group_lut_scores(tables, index.codes, 0.5, T, g, block_n=16).view(B, Hkv, 1, T, N)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert torch.allclose(fused, selector.score(query, index, keys, 0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interpret", ["0", "1"], ids=["torch path", "triton path"])
def test_the_tables_are_rounded_to_float16_saturating_at_its_largest_value(interpret, monkeypatch):
    """The scores sum float16 table entries (in float32): each entry q_m·c_{m,j} rounded to nearest, and beyond
    float16's range ±65504 instead of ±inf — on the torch path and on the Triton kernel."""
    if interpret == "1":
        pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    from oa_plugins.selectors.pq import HALF_MAX

    gen = torch.Generator().manual_seed(6)
    B, Hkv, g, N, D = 1, 2, 2, 40, 8
    keys = torch.randn(B, Hkv, N, D, generator=gen)
    decode = torch.randn(B, Hkv * g, 1, D, generator=gen)
    decode[:, 0] *= 1e6  # head 0's entries far past float16's range
    selector = ProductQuantisedSelector(PQSConfig(dims=4, bits=4))
    index = selector.build(keys, None, _everywhere(B, Hkv, N))
    scores = selector.score(group_queries(decode, Hkv, shared=False), index, keys, 0.5)  # [B, Hkv, g, 1, N]
    entries = torch.einsum(
        "bhgmd,bhmcd->bhgmc", decode.double().view(B, Hkv, g, 2, 4), index.centroids.double()
    )  # [B, Hkv, g, M, C]
    rounded = entries.clamp(-HALF_MAX, HALF_MAX).half().double()
    codes = _codes(index).permute(0, 1, 3, 2)[:, :, None].expand(B, Hkv, g, 2, N)  # [B, Hkv, g, M, N]
    expected = 0.5 * rounded.gather(-1, codes).sum(3)  # [B, Hkv, g, N]
    assert scores.isfinite().all()
    assert torch.allclose(scores[:, :, :, 0].double(), expected, rtol=1e-6, atol=1e-6)
    unrounded = 0.5 * entries.gather(-1, codes).sum(3)
    assert (expected[0, 0, 1] - unrounded[0, 0, 1]).abs().max() > 1e-5  # the rounding moved some in-range score
    assert (entries[0, 0, 0].abs() > HALF_MAX).any()  # and head 0's saturated


@pytest.mark.parametrize("sub_spaces", [1, 4, 7])
def test_4_bit_codes_are_kept_two_a_byte_low_nibble_first(sub_spaces):
    """The index keeps 16-centroid codes two a byte — byte j holds sub-space 2j in its low nibble, 2j + 1 in its high
    one, 0 past the last — so a key costs the D/4 bytes ``scoring_bytes`` counts; unpacking gives the codes back."""
    codes = torch.randint(0, 16, (2, 3, 5, sub_spaces), generator=torch.Generator().manual_seed(4)).to(torch.uint8)
    kept = pack_codes(codes)
    assert kept.dtype == torch.uint8 and kept.shape == (2, 3, 5, (sub_spaces + 1) // 2)
    assert torch.equal(kept[..., 0] & 15, codes[..., 0])
    if sub_spaces > 1:
        assert torch.equal(kept[..., 0] >> 4, codes[..., 1])
    else:
        assert not (kept >> 4).any()
    assert torch.equal(unpack_codes(kept, sub_spaces), codes)
    keys = torch.randn(1, 2, 300, 64, generator=torch.Generator().manual_seed(5))
    selector = ProductQuantisedSelector(PQSConfig())  # the default: 16 centroids a pair of dimensions
    index = selector.build(keys, None, _everywhere(1, 2, 300))
    assert index.codes.shape[-1] * index.codes.element_size() == selector.scoring_bytes(64) == 16


def test_new_keys_are_coded_by_the_centroids_prepare_learnt():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 600, 16, generator=gen)
    selector = ProductQuantisedSelector(PQSConfig(dims=4))
    first = selector.build(keys[:, :, :500], None, _everywhere(1, 2, 500))
    grown = selector.extend(first, keys[:, :, 500:])
    assert torch.equal(grown.centroids, first.centroids) and torch.equal(grown.codes[:, :, :500], first.codes)
    points = sub_spaces(keys[:, :, 500:], 4)
    expected = (points[..., :, None, :] - first.centroids[..., None, :, :]).norm(dim=-1).argmin(-1).permute(0, 1, 3, 2)
    assert torch.equal(_codes(grown)[:, :, 500:], expected)
    assert torch.equal(selector.extend(grown, keys[:, :, :0]).codes, grown.codes)  # no new keys: no growth


@pytest.mark.parametrize(
    "dims, bits, dim, iterations",
    [(2, 4, 8, 8), (3, 4, 15, 3), (2, 8, 4, 1)],
    ids=["the default's code", "an odd count of sub-spaces", "8 bits"],
)
def test_the_gpu_prepare_learns_and_codes_every_key_as_the_torch_code(dims, bits, dim, iterations, monkeypatch):
    """Under the interpreter, ``build`` as a GPU runs it (``pq_programs``: every sub-space's k-means in one launch,
    every key's codes in one more) gives the torch code's centroids and codes, bit for bit: a row whose region
    leaves keys out, a row with fewer training keys than centroids (emptied clusters keep their centre), a row with
    none; 8-bit codes, 256 centroids."""
    pytest.importorskip("triton")
    from oa_plugins.selectors import pq

    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(3, 2, 300, dim, generator=gen).to(torch.bfloat16)
    assignment = torch.zeros(3, 2, 300, dtype=torch.long)
    assignment[0, :, :40] = 4  # outside the clusters: not trained on
    assignment[1, :, 10:] = 4  # 10 training keys: fewer than 16 centroids
    assignment[2] = 4  # none
    clusters = Clusters(assignment, 4)
    selector = ProductQuantisedSelector(PQSConfig(dims=dims, bits=bits, iterations=iterations, train=256))
    expected = selector.build(keys, None, clusters)
    monkeypatch.setattr(pq, "on_gpu", lambda tensor: True)
    index = selector.build(keys, None, clusters)
    assert torch.equal(index.centroids, expected.centroids)
    assert torch.equal(index.codes, expected.codes)
    assert torch.equal(pq.encode(keys[:, :, 5:6], index.centroids), expected.codes[:, :, 5:6])  # one new key


def test_more_training_keys_than_a_gpu_program_holds_take_the_shared_kernels(monkeypatch):
    """``pq_programs.train_triton`` keeps a problem's training points in registers, at most MAX_POINTS coordinates:
    it refuses more by name, and ``build`` sends such a ``train`` to the torch path's k-means instead."""
    pytest.importorskip("triton")
    from oa_plugins.selectors import pq, pq_programs

    n = pq_programs.MAX_POINTS  # × 2 dimensions: twice what a program holds
    keys = torch.randn(1, 1, n + 80, 4, generator=torch.Generator().manual_seed(3))
    clusters = Clusters(torch.zeros(1, 1, n + 80, dtype=torch.long), 4)
    positions, chosen = training_positions(clusters.assignment[:, 0] < 4, n)
    with pytest.raises(ValueError, match=rf"train_triton: {n} training points of 2 dimensions past MAX_POINTS"):
        pq_programs.train_triton(keys, positions, chosen, 2, 16, 1)
    selector = ProductQuantisedSelector(PQSConfig(iterations=1, train=n))
    expected = selector.build(keys, None, clusters)
    monkeypatch.setattr(pq, "on_gpu", lambda tensor: True)  # the GPU's choice; the codes by encode_triton
    index = selector.build(keys, None, clusters)
    assert torch.equal(index.centroids, expected.centroids) and torch.equal(index.codes, expected.codes)


def test_the_centroids_learn_from_at_most_train_keys_spread_over_the_region():
    region = torch.zeros(2, 1000, dtype=torch.bool)
    region[0, 4:980] = True
    region[1, 300:500] = True
    positions, chosen = training_positions(region, 256)
    assert positions.shape == (2, 256)
    assert chosen[0].sum() <= 256 and chosen[1].sum() == 200  # a region smaller than the bound: all of it
    assert all(bool(region[row, positions[row][chosen[row]]].all()) for row in range(2))
    where = positions[0][chosen[0]]
    assert where[0] == 4 and where[-1] > 900  # from the region's first key to near its end, evenly
    assert (where.diff() == where.diff()[0]).all()
    assert torch.equal(positions[1][:200], torch.arange(300, 500))  # chosen first, in order


def _outlier_case():
    """Many keys spread in dims 0-3, where every prefill query looks, and one (row 300) far out along dim 13, where
    none does; a decode query that looks along dim 13 too (a needle's answer on Gemma-3, README)."""
    gen = torch.Generator().manual_seed(4)
    keys = 0.1 * torch.randn(1, 1, 1024, 16, generator=gen)
    keys[..., :4] *= 30
    keys[0, 0, 300, 13] = 3.0
    prefill = torch.zeros(1, 2, 64, 16)
    prefill[..., :4] = torch.randn(1, 2, 64, 4, generator=gen)
    decode = torch.zeros(1, 2, 1, 16)
    decode[..., :4] = torch.randn(1, 2, 1, 4, generator=gen)
    decode[..., 13] = 10.0
    return keys, prefill, decode


@pytest.mark.parametrize(
    "selector, found",
    [({"name": "pq", "rerank": 0}, True), ({"name": "qgs", "rank": 4, "key_rank": 0, "rerank": 0}, False)],
    ids=["pq", "qgs in the query subspace"],
)
def test_a_key_where_no_context_query_looks_is_selected(selector, found):
    """PQ codes every dimension, so the key reaches the selection whatever direction the query takes; a code of the
    context queries' subspace does not see it."""
    keys, prefill, decode = _outlier_case()
    pipe = oa.build(
        {
            "clusterer": {"name": "qgc", "num_clusters": 4, "rank": 4},
            "kernel": "torch",
            "selector": selector,
            "allocator": "global",
            "tail": "discard",
            "budget": {"tokens": 20},
            "sink": 4,
            "local": 8,
        }
    )
    state = pipe.prepare(keys, keys.clone(), prefill)
    assert bool((pipe.explain(decode, state).selection.index == 300).any()) is found


def test_a_head_dim_the_sub_spaces_do_not_divide_is_refused():
    selector = ProductQuantisedSelector(PQSConfig(dims=8))
    with pytest.raises(ValueError, match="selector 'pq': dims 8 does not divide the head dim 12"):
        selector.build(torch.randn(1, 1, 300, 12), None, _everywhere(1, 1, 300))
    with pytest.raises(oa.SpecError, match="dims"):
        oa.build({"selector": {"name": "pq", "dims": 0}})


def test_the_score_kernel_refuses_codes_and_buffers_of_another_layout():
    """``group_lut_scores`` names what does not fit before it launches: codes whose bytes per key are not the
    sub-spaces' (4-bit codes kept a byte each), and an ``out`` buffer of another shape."""
    pytest.importorskip("triton")
    from oa_plugins.selectors import pq

    tables = torch.zeros(1, 2, 3, 4, 16)  # 4 sub-spaces of 16 centroids: 2 bytes a key
    with pytest.raises(ValueError, match="4 code bytes per key for 4 sub-spaces of 16 centroids"):
        pq.group_lut_scores(tables, torch.zeros(1, 2, 10, 4, dtype=torch.uint8), 0.5, 1, 3)
    with pytest.raises(ValueError, match=r"out must be a contiguous float32 \[1, 2, 1, 10\] tensor"):
        pq.group_lut_scores(tables, torch.zeros(1, 2, 10, 2, dtype=torch.uint8), 0.5, 1, 3, out=torch.zeros(1, 2, 10))
