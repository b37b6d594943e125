"""Water-filling (paper Eq. 7), shared by the allocators: the torch ops and the Triton kernel (under the
interpreter)."""

import math

import pytest
import torch

from oa_core.ops.water_filling import water_fill


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [1, 17, 100, 399])
def test_quotas_sum_to_the_budget_and_respect_cluster_sizes(seed, budget):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 30, (3, 24), generator=gen).float()
    log_priority = torch.randn(3, 24, generator=gen) * 10
    quotas = water_fill(log_priority, counts, budget)
    assert torch.equal(quotas.sum(-1), torch.minimum(torch.tensor(budget), counts.sum(-1).long()))
    assert (quotas >= 0).all() and (quotas <= counts).all()


def test_each_row_gets_its_own_budget():
    counts = torch.full((3, 10), 8.0)
    quotas = water_fill(torch.zeros(3, 10), counts, torch.tensor([5, 0, 200]))
    assert quotas.sum(-1).tolist() == [5, 0, 80]


def test_quotas_are_proportional_to_the_estimate_until_a_cluster_is_full():
    counts = torch.tensor([100.0, 100.0, 100.0, 2.0])
    priority = torch.log(torch.tensor([4.0, 2.0, 1.0, 8.0]))
    quotas = water_fill(priority, counts, 30)
    # Cluster 3 caps at 2; the rest (28) splits 4:2:1 → 16, 8, 4.
    assert quotas.tolist() == [16, 8, 4, 2]


def test_the_triton_water_fill_matches_the_torch_one():
    """The GPU path of water-filling (one Triton program per row, no sort), run by Triton's interpreter here."""
    pytest.importorskip("triton")
    from oa_core.ops.water_filling import water_fill_triton

    gen = torch.Generator().manual_seed(0)
    rows, C = 40, 24
    log_priority = torch.randn(rows, C, generator=gen, dtype=torch.float64) * 4
    log_priority[0, 3:] = -math.inf  # only three clusters may take budget first
    log_priority[1] = 2.0  # all tied
    capacity = torch.randint(0, 30, (rows, C), generator=gen).double()
    capacity[2] = 0  # nothing to read
    budget = torch.randint(0, 400, (rows,), generator=gen).double()
    fast = water_fill_triton(log_priority, capacity, budget)
    reference = water_fill(log_priority, capacity, budget)
    assert torch.equal(fast, reference)
    assert torch.equal(fast.sum(-1), torch.minimum(budget, capacity.sum(-1)).long())


@pytest.mark.parametrize("C", [5, 64])
def test_the_triton_water_fill_matches_the_torch_one_at_other_sizes(C):
    pytest.importorskip("triton")
    from oa_core.ops.water_filling import water_fill_triton

    gen = torch.Generator().manual_seed(C)
    rows = 12
    log_priority = torch.randn(rows, C, generator=gen, dtype=torch.float64) * 3
    log_priority[0] = -math.inf  # no priorities at all: split by size
    capacity = torch.randint(0, 50, (rows, C), generator=gen).double()
    budget = torch.randint(0, 40 * C, (rows,), generator=gen).double()
    budget[1] = 0
    assert torch.equal(water_fill_triton(log_priority, capacity, budget), water_fill(log_priority, capacity, budget))


def test_a_budget_that_fills_the_leading_clusters_exactly_fills_them():
    """Two clusters hold nearly all the priority (e^40 over the rest) and their sizes, 6 + 9, are the budget: the
    target lies on the second one's breakpoint. The Triton kernel once found that breakpoint passed by rounding,
    took λ = 0 and emptied every cluster (then one row each by remainders), where the torch ops keep 6 and 9."""
    pytest.importorskip("triton")
    from oa_core.ops.water_filling import water_fill_triton

    log_priority = torch.full((1, 13), -45.0, dtype=torch.float64)
    log_priority[0, 8], log_priority[0, 11] = -0.5494, -1.1656
    capacity = torch.tensor([[9.0, 12, 11, 15, 18, 10, 10, 15, 6, 19, 10, 9, 10]], dtype=torch.float64)
    for budget in (14, 15, 16):
        expected = water_fill(log_priority, capacity, torch.tensor([budget]))
        assert torch.equal(water_fill_triton(log_priority, capacity, torch.tensor([float(budget)])), expected)
    assert water_fill(log_priority, capacity, torch.tensor([15]))[0].tolist() == [0] * 8 + [6, 0, 0, 9, 0]
