"""Index tensors with a spare slot (oa_core.scatter)."""

import pytest
import torch

from oa_core.scatter import count_by_slot, positions, sum_by_slot


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
