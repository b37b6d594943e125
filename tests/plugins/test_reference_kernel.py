import math

import pytest
import torch

from oa_core.components import PooledClusters, Selection
from oa_core.testing import references
from oa_plugins.kernels.reference import TorchKernel


def pooled(keys, values, assignment, clusters):
    one_hot = torch.nn.functional.one_hot(assignment, clusters + 1)[..., :clusters].float()
    return PooledClusters(
        one_hot.sum(2), one_hot.transpose(-1, -2) @ keys.float(), one_hot.transpose(-1, -2) @ values.float(), assignment
    )


def test_matches_the_formula_with_ragged_clusters_full_reads_and_empty_selections():
    gen = torch.Generator().manual_seed(0)
    B, Hkv, g, T, N, D, C = 2, 2, 2, 2, 24, 8, 4
    keys = torch.randn(B, Hkv, N, D, generator=gen, dtype=torch.float64)
    values = torch.randn(B, Hkv, N, D, generator=gen, dtype=torch.float64)
    query = torch.randn(B, Hkv * g, T, D, generator=gen, dtype=torch.float64)
    assignment = torch.randint(C, (B, Hkv, N), generator=gen)
    assignment[..., :2] = C  # sink
    assignment[0, 0, 2:7] = 0  # cluster 0 of row (0,0) will be read completely
    assignment[0, 0, 7:] = 1 + assignment[0, 0, 7:] % (C - 1)
    index = torch.full((B, Hkv, g, T, 6), -1)
    index[..., 0] = 0
    index[0, 0, :, :, 1:6] = torch.arange(2, 7)
    index[1, 1, 1, 1, :] = -1  # an empty selection: proxies only
    index[1, 0, 0, 0, 1:4] = torch.tensor([9, 10, 11])
    log_weight = torch.zeros(index.shape, dtype=torch.float64)
    out, proxies = TorchKernel().attend(
        query, keys, values, Selection(index, log_weight), pooled(keys, values, assignment, C), 0.3
    )
    assert out.shape == query.shape and torch.isfinite(out).all()
    expected = references.proxy_attention(query, keys, values, index, assignment, C, 0.3, log_weight)
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-6)
    full_cluster_rows = proxies[0, 0]
    assert (full_cluster_rows <= C - 1).all()  # the fully read cluster has no proxy


def test_shared_selection_serves_the_whole_group():
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(1, 2, 30, 8, generator=gen), torch.randn(1, 2, 30, 8, generator=gen)
    query = torch.randn(1, 6, 1, 8, generator=gen)
    shared = torch.randint(30, (1, 2, 1, 1, 5), generator=gen)
    kernel = TorchKernel()
    out, _ = kernel.attend(query, keys, values, Selection(shared, torch.zeros(shared.shape)), None, 0.5)
    per_head = shared.expand(1, 2, 3, 1, 5)
    again, _ = kernel.attend(query, keys, values, Selection(per_head, torch.zeros(per_head.shape)), None, 0.5)
    assert torch.allclose(out, again)


def test_log_weight_multiplies_a_rows_weight():
    keys, values = torch.zeros(1, 1, 2, 4), torch.eye(4)[:2].view(1, 1, 2, 4)
    index = torch.tensor([0, 1]).view(1, 1, 1, 1, 2)
    out, _ = TorchKernel().attend(
        torch.zeros(1, 1, 1, 4),
        keys,
        values,
        Selection(index, torch.tensor([0.0, math.log(3)]).view(1, 1, 1, 1, 2)),
        None,
        1.0,
    )
    assert torch.allclose(out.flatten()[:2], torch.tensor([0.25, 0.75]))


def test_dense_path_matches_softmax_attention():
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(2, 3, 40, 16, generator=gen), torch.randn(2, 3, 40, 16, generator=gen)
    query = torch.randn(2, 12, 3, 16, generator=gen)
    out, proxies = TorchKernel().attend(query, keys, values, None, None, 0.25)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(4, 1), values.repeat_interleave(4, 1), scale=0.25
    )
    assert proxies is None and torch.allclose(out, expected, atol=1e-5)


def _tail_share(second_order: bool, spread: float, seed: int, read: str = "top") -> tuple[float, float]:
    """One cluster of 201 keys around a common mean, one row read exactly (``read``: the query's top row, as a
    selector would read it, or its bottom row) and the rest left to the cluster's proxy; values mark the tail (1, 0)
    and the read row (0, 1), so an output's first coordinate is the tail's share of the softmax. → (the kernel's
    share, the exact share)."""
    gen = torch.Generator().manual_seed(seed)
    D, N = 16, 201
    keys = torch.randn(1, 1, N, D, generator=gen, dtype=torch.float64) * spread + torch.randn(
        D, generator=gen, dtype=torch.float64
    )
    query = torch.randn(1, 1, 1, D, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(D)
    logits = scale * keys[0, 0] @ query[0, 0, 0]
    row = int(logits.argmax() if read == "top" else logits.argmin())
    values = torch.zeros(1, 1, N, D, dtype=torch.float64)
    values[..., 0] = 1.0
    values[..., row, :2] = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assignment = torch.zeros(1, 1, N, dtype=torch.long)
    sums = pooled(keys, values, assignment, 1)
    sums = PooledClusters(
        sums.count,
        sums.key_sum,
        sums.value_sum,
        assignment,
        (keys * keys).sum(2, keepdim=True).float(),
        second_order=second_order,
    )
    index = torch.full((1, 1, 1, 1, 1), row, dtype=torch.long)
    out, _ = TorchKernel().attend(query, keys, values, Selection(index, torch.zeros(index.shape)), sums, scale)
    exact = 1.0 - torch.softmax(logits, 0)[row]
    return float(out[0, 0, 0, 0]), float(exact)


def test_a_second_order_proxy_estimates_the_tails_mass_closer_than_the_mean_proxy():
    # E_T[e^z] ≥ e^{E_T z} (Jensen): the mean proxy always under-weights a tail whose logits spread; the second-order
    # term e^{z̄}(1 + σ̂²/2) recovers most of the gap while the spread is moderate (σ̂ up to about 1). The cluster's
    # top row is read, as a selector reads it: the tail lies below it and the bound (M_b − z̄_T)² leaves room.
    for seed in range(8):
        for spread in (0.5, 1.0, 2.0):
            mean, exact = _tail_share(False, spread, seed)
            second, _ = _tail_share(True, spread, seed)
            assert mean < exact
            recovered = 0.5 if spread <= 1.0 else 0.0  # at σ̂ ≈ 2 it is still closer, by less
            assert abs(second - exact) < (1 - recovered) * abs(mean - exact), (seed, spread, mean, second, exact)


def test_a_tail_below_a_row_read_low_keeps_the_mean_proxy():
    # The tail's variance is bounded by (M_b − z̄_T)², M_b the least logit read from the cluster: a read row below the
    # tail's mean (a selector's miss) leaves no room for a correction, and the proxy is the paper's mean proxy.
    for seed in range(4):
        mean, _ = _tail_share(False, 1.0, seed, read="bottom")
        second, _ = _tail_share(True, 1.0, seed, read="bottom")
        assert second == pytest.approx(mean, abs=1e-12)
        top_mean, _ = _tail_share(False, 1.0, seed)
        top_second, _ = _tail_share(True, 1.0, seed)
        assert top_second > top_mean + 1e-4


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tail", ["proxy", "discard"])
def test_gathered_rows_and_one_read_of_the_cache_give_the_formula(T, shared, tail):
    """Rows read by few queries are gathered (T = 1: 2 × 5 rows of a 64-row cache; shared, T = 8: 40); by many, the
    cache is read once (per head, T = 8: 80 rows): both are Eq. 1, padding and the sink in every row included."""
    gen = torch.Generator().manual_seed(T)
    B, Hkv, g, N, D, C, K = 2, 2, 2, 64, 8, 5, 5
    keys = torch.randn(B, Hkv, N, D, generator=gen, dtype=torch.float64)
    values = torch.randn(B, Hkv, N, D, generator=gen, dtype=torch.float64)
    query = torch.randn(B, Hkv * g, T, D, generator=gen, dtype=torch.float64)
    assignment = torch.randint(C, (B, Hkv, N), generator=gen)
    assignment[..., 0] = C  # the sink
    Gs = 1 if shared else g
    rows = torch.rand(B, Hkv, Gs, T, N - 1, generator=gen).argsort(-1)[..., : K - 1] + 1  # distinct, past the sink
    index = torch.cat([torch.zeros_like(rows[..., :1]), rows], -1)
    index = torch.where(torch.rand(index.shape, generator=gen) < 0.2, -1, index)  # padding
    log_weight = torch.zeros(index.shape, dtype=torch.float64)
    proxies = pooled(keys, values, assignment, C) if tail == "proxy" else None
    out, _ = TorchKernel().attend(query, keys, values, Selection(index, log_weight), proxies, 0.4)
    expected = references.proxy_attention(
        query, keys, values, index, assignment if proxies else None, C, 0.4, log_weight
    )
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-6)
