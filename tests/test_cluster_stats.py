"""The allocators' cluster statistics z̄_b, σ̂_b² from one Triton kernel (under the interpreter) against torch."""

import pytest
import torch

pytest.importorskip("triton")

from oa_core.cluster_stats import cluster_logit_stats  # noqa: E402


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
    reference = (0.3 * torch.einsum("bhgtd,bhcd->bhgtc", q, key_mean.double()),
                 0.09 * torch.einsum("bhgtd,bhcd->bhgtc", q * q, key_var.double()))
    for got, want in zip(fast, reference):
        assert got.shape == (B, Hkv, Hq // Hkv, T, C) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    torch_path = cluster_logit_stats(query, key_mean, key_var, 0.3, use_triton=False)
    for got, want in zip(torch_path, reference):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
