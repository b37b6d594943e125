import math
import os

# The test suite runs the Triton kernels on CPU tensors: through Triton's interpreter, which must be chosen before
# any kernel is defined (the kernels' module is imported when the plugins load). CI has no GPU; on a GPU machine the
# device benchmarks exercise the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oa_core.testing import make_inputs  # noqa: E402,F401  (the tests' inputs are the conformance kit's)


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
