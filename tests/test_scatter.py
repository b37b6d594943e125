"""Index tensors with a spare slot (oa_core.ops.scatter)."""

import pytest
import torch

from oa_core.ops.scatter import count_by_slot, min_by_slot, positions, sum_by_slot


def test_sums_and_counts_by_slot_drop_the_spare_and_add_to_a_total():
    ids = torch.tensor([[0, 2, 3, 2, 0, 3]])  # 3: no slot
    values = torch.arange(12.0).view(1, 6, 2)
    assert sum_by_slot(ids, values, 3).tolist() == [[[8.0, 10.0], [0.0, 0.0], [8.0, 10.0]]]
    assert count_by_slot(ids, 3).tolist() == [[2, 0, 2]]
    total = torch.ones(1, 3, 2)
    assert sum_by_slot(ids, values, 3, total).tolist() == [[[9.0, 11.0], [1.0, 1.0], [9.0, 11.0]]]


@pytest.mark.parametrize("width", [None, 0, 3, 1000])
def test_positions_lists_each_rows_true_positions_in_order(width):
    mask = torch.rand(3, 2, 40, generator=torch.Generator().manual_seed(2)) < 0.3
    mask[0, 0] = False  # a row with none
    out = positions(mask, width)
    expected_width = min(int(mask.sum(-1).max()) if width is None else width, 40)
    assert out.shape == (3, 2, expected_width)
    for row, listed in zip(mask.view(-1, 40), out.reshape(6, expected_width)):
        truth = row.nonzero().flatten().tolist()[:expected_width]
        assert listed.tolist() == truth + [-1] * (expected_width - len(truth))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pooled_sums_in_one_triton_pass_equal_the_scatter_adds(dtype):
    """Under the interpreter: the sorted-gather kernel gives the four scatter-adds' count, Σk, Σv and Σk⊙k per
    slot — rows of no slot left out, an empty slot zero, rows read in place from a view of a larger cache (its
    unread slots NaN), in the cache's dtype, and added to totals."""
    from oa_core.ops import triton_path
    from oa_core.ops.scatter import pooled_sums

    if triton_path.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(triton_path.unavailable_reason(torch.device("cpu")))
    gen = torch.Generator().manual_seed(3)
    B, H, n, D, slots = 2, 3, 90, 20, 7
    cache = torch.full((B, H, n + 10, 2 * D), float("nan"), dtype=dtype)
    cache[:, :, :n] = torch.randn(B, H, n, 2 * D, generator=gen).to(dtype)
    keys, values = cache[:, :, :n, :D], cache[:, :, :n, D:]
    ids = torch.randint(0, slots + 1, (B, H, n), generator=gen)
    ids[ids == 4] = 5  # slot 4 empty
    totals = tuple(torch.rand(shape, generator=gen) for shape in [(B, H, slots)] + [(B, H, slots, D)] * 3)
    for given in (None, totals):
        expected = pooled_sums(ids, keys, values, slots, given, use_triton=False)
        found = pooled_sums(ids, keys, values, slots, given, use_triton=True)
        for name, a, b in zip(("count", "key_sum", "value_sum", "key_square_sum"), found, expected):
            assert a.dtype == torch.float32 and a.shape == b.shape, name
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-4), name
    assert found[0][..., 4].equal(totals[0][..., 4]) and found[1][..., 4, :].equal(totals[1][..., 4, :])


def test_min_by_slot_takes_each_slots_least_and_inf_where_none_fell():
    ids = torch.tensor([[0, 2, 0, 3, 2]])  # 3 = none (slots = 3): dropped
    values = torch.tensor([[4.0, -1.0, 2.5, -9.0, 7.0]])
    least = min_by_slot(ids, values, 3)
    assert least.tolist() == [[2.5, float("inf"), -1.0]]
