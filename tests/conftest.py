import math
import os

# The test suite runs the Triton kernels on CPU tensors: through Triton's interpreter, which must be chosen before
# any kernel is defined (the kernels' module is imported when the plugins load). CI has no GPU; on a GPU machine the
# device benchmarks exercise the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def make_inputs(batch=2, kv_heads=2, group=3, tokens=300, dim=32, queries=2, dtype=torch.float32, seed=0):
    """A cache with clustered, unevenly scaled keys (so attention is peaked, as in real models), prefill queries and
    decode queries drawn near the keys. Returns (keys, values, prefill_queries, decode_queries)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(batch, kv_heads, 12, dim, generator=gen) * 2
    member = torch.randint(12, (batch, kv_heads, tokens), generator=gen)
    keys = centres.gather(2, member[..., None].expand(-1, -1, -1, dim)) + 0.7 * torch.randn(
        batch, kv_heads, tokens, dim, generator=gen)
    values = torch.randn(batch, kv_heads, tokens, dim, generator=gen)
    heads = kv_heads * group
    prefill = torch.randn(batch, heads, 64, dim, generator=gen) * 1.5
    picks = torch.randint(tokens, (queries,), generator=gen)
    decode = keys[:, (torch.arange(heads) // group)[:, None], picks[None, :]] * 1.2
    decode = decode + 0.3 * torch.randn(decode.shape, generator=gen)
    return tuple(t.to(dtype) for t in (keys, values, prefill, decode))


def dense_attention(query, keys, values, scale=None):
    """float64 softmax attention with GQA: [B,Hq,T,D] x [B,Hkv,N,D] -> [B,Hq,T,D]."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
    return torch.softmax(scale * query.double() @ k.transpose(-1, -2), dim=-1) @ v


def relative_error(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture
def inputs():
    return make_inputs()
