"""Dense decode attention over a static cache (oa_core.ops.dense_decode): the Triton flash decoding, under the
interpreter, against softmax attention over each row's valid slots."""

import pytest
import torch

from conftest import dense_attention, relative_error
from oa_core.ops.dense_decode import dense_decode, dense_decode_reference


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 1e-2), (torch.bfloat16, 2e-2)])
def test_flash_decoding_reads_each_rows_valid_slots(dtype, tolerance):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    B, Hkv, g, capacity, D = 3, 2, 3, 1300, 32  # several splits, the last one partly written
    keys = torch.randn(B, Hkv, capacity, D, generator=gen)
    values = torch.randn(B, Hkv, capacity, D, generator=gen)
    query = torch.randn(B, Hkv * g, 1, D, generator=gen)
    length, start = torch.tensor(1100), torch.tensor([0, 37, 600])  # row 2: a whole split of padding
    keys[..., 1100:, :] = 1e4  # unwritten slots must not count
    out = dense_decode(query.to(dtype), keys.to(dtype), values.to(dtype), length, start, 0.2)
    for b in range(B):
        rows = slice(int(start[b]), 1100)
        expected = dense_attention(query[b : b + 1], keys[b : b + 1, :, rows], values[b : b + 1, :, rows], scale=0.2)
        assert relative_error(out[b : b + 1].float(), expected) < tolerance
    reference = dense_decode_reference(query, keys, values, length, start, 0.2)
    assert relative_error(out.float(), reference) < tolerance
