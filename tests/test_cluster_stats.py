"""The allocators' cluster statistics z̄_b, σ̂_b² from one Triton kernel (under the interpreter) against torch."""

import pytest
import torch

pytest.importorskip("triton")

from oa_core.ops.cluster_stats import cluster_logit_stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C, D", [(40, 64), (5, 24)], ids=["several cluster blocks", "D not a power of two"])
def test_the_kernel_matches_torch(C, D, dtype):
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, T = 2, 6, 2, 3
    query = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    key_mean = torch.randn(B, Hkv, C, D, generator=gen)
    key_var = torch.rand(B, Hkv, C, D, generator=gen)
    fast = cluster_logit_stats(query, key_mean, key_var, 0.3, use_triton=True)
    q = query.double().reshape(B, Hkv, Hq // Hkv, T, D)
    reference = (
        0.3 * torch.einsum("bhgtd,bhcd->bhgtc", q, key_mean.double()),
        0.09 * torch.einsum("bhgtd,bhcd->bhgtc", q * q, key_var.double()),
    )
    for got, want in zip(fast, reference):
        assert got.shape == (B, Hkv, Hq // Hkv, T, C) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    torch_path = cluster_logit_stats(query, key_mean, key_var, 0.3, use_triton=False)
    for got, want in zip(torch_path, reference):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_statistics_from_the_pooled_sums_match_the_moments():
    """The fast path's kernel turns Σk, Σk⊙k and n_b into k̄_b, Var_b(k) itself: the same statistics as from the
    moments the state derives (empty clusters included: n_b taken as 1)."""
    from oa_core.ops.cluster_stats import cluster_logit_stats_from_sums

    gen = torch.Generator().manual_seed(1)
    B, Hq, Hkv, T, C, D = 2, 6, 2, 1, 20, 32
    query = torch.randn(B, Hq, T, D, generator=gen)
    count = torch.randint(0, 9, (B, Hkv, C), generator=gen).float()
    rows = torch.randn(B, Hkv, C, 8, D, generator=gen) * (torch.arange(8) < count[..., None]).unsqueeze(-1)
    key_sum, key_square_sum = rows.sum(3), (rows * rows).sum(3)
    n = count.clamp_min(1).unsqueeze(-1)
    mean = key_sum / n
    expected = cluster_logit_stats(query, mean, (key_square_sum / n - mean * mean).clamp_min(0), 0.3, use_triton=False)
    got = cluster_logit_stats_from_sums(query, count, key_sum, key_square_sum, 0.3)
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
