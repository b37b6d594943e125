"""The ablation components' defining properties (paper Tables 1 and 3), and that each runs in a pipeline."""

import math

import pytest
import torch

import oa_core as oa
from conftest import make_inputs
from oa_core.components import AllocationInput
from oa_core.ops.kmeans import nearest
from oa_plugins.allocators.mass import MassAllocator
from oa_plugins.allocators.uniform import UniformAllocator
from oa_plugins.allocators.variance import VarianceAllocator
from oa_plugins.clusterers.kmeans import KeyKMeans, KMeansConfig
from oa_plugins.clusterers.position import PositionBlocks, PositionConfig


def allocation(mean_logit, logit_var, counts, budget):
    shape = (1, 1, 1, 1, -1)
    return AllocationInput(
        mean_logit.view(shape),
        logit_var.view(shape),
        counts.view(1, 1, -1),
        torch.zeros(1, 1, 1, 1, 1),
        torch.zeros(1, 1, 1, dtype=torch.long),
        torch.tensor(budget).view(1, 1, 1, 1),
    )


def test_uniform_allocation_splits_evenly():
    counts = torch.tensor([50.0, 50, 50, 3, 50, 50])
    quotas = UniformAllocator().allocate(allocation(torch.randn(6), torch.rand(6), counts, 103)).flatten()
    assert quotas[3] == 3 and int(quotas.sum()) == 103  # the small cluster is full, the rest share 100
    assert quotas[[0, 1, 2, 4, 5]].tolist() == [20] * 5


def test_mass_follows_the_mean_logit_and_variance_the_spread():
    counts = torch.full((10,), 100.0)
    rising = torch.linspace(-2, 2, 10)
    mass = MassAllocator().allocate(allocation(rising, torch.ones(10), counts, 200)).flatten()
    assert (mass.diff() >= 0).all() and mass[-1] > mass[0]
    spread = VarianceAllocator().allocate(allocation(torch.zeros(10), rising.exp(), counts, 200)).flatten()
    assert (spread.diff() >= 0).all() and spread[-1] > spread[0]
    # Mass ignores the spread, variance ignores the mean.
    flat = MassAllocator().allocate(allocation(torch.zeros(10), rising.exp(), counts, 200)).flatten()
    assert flat.max() - flat.min() <= 1


@pytest.mark.parametrize(
    "allocator, priority",
    [
        (MassAllocator, lambda z, var, n: n * z.exp()),  # n_b e^{z̄_b}: the cluster's attention mass
        (VarianceAllocator, lambda z, var, n: var.sqrt()),  # σ̂_b
    ],
    ids=["mass", "variance"],
)
def test_mass_and_variance_water_fill_their_priorities(allocator, priority):
    """Eq. 7 with the ablations' priorities against the float64 reference, clusters of different sizes."""
    from oa_core.testing import references

    gen = torch.Generator().manual_seed(3)
    for budget in (9, 120, 700):
        z, var = torch.randn(16, generator=gen, dtype=torch.float64), torch.rand(16, generator=gen, dtype=torch.float64)
        n = torch.randint(1, 80, (16,), generator=gen).double()
        quotas = allocator().allocate(allocation(z.float(), var.float(), n.float(), budget)).flatten()
        ideal = references.water_fill(priority(z, var, n).log(), n, budget)
        assert not references.rounding_violations(quotas, ideal, n).any()


def test_position_blocks_are_contiguous_runs_of_the_region():
    mask = torch.ones(2, 100, dtype=torch.bool)
    mask[0, :30] = False  # padding
    mask[:, -10:] = False  # local window
    for config, limit in ((PositionConfig(block_size=16), 16), (PositionConfig(num_blocks=7), None)):
        clusters = PositionBlocks(config).fit(torch.randn(2, 3, 100, 4), None, mask, torch.Generator())
        assignment = clusters.assignment
        assert (assignment[~mask[:, None].expand(2, 3, 100)] == clusters.num_clusters).all()
        for row in range(2):
            ids = assignment[row, 0][mask[row]]
            assert (ids.diff() >= 0).all() and (ids.diff() <= 1).all()  # runs, in order, none skipped
            sizes = torch.bincount(ids)
            assert limit is None or sizes.max() <= limit
        if limit is None:
            assert clusters.num_clusters == 7


def test_position_rejects_both_size_and_count():
    with pytest.raises(oa.SpecError, match=r"clusterer: .*give block_size or num_blocks, not both"):
        oa.build({"clusterer": {"name": "position", "block_size": 8, "num_blocks": 4}})


def test_key_kmeans_converges_to_a_fixed_point():
    keys = make_inputs(batch=2, kv_heads=2, tokens=200, seed=4)[0]
    mask = torch.ones(2, 200, dtype=torch.bool)
    clusters = KeyKMeans(KMeansConfig(num_clusters=10, iterations=100)).fit(
        keys, None, mask, torch.Generator().manual_seed(0)
    )
    centroids = clusters.space
    assert torch.equal(nearest(keys.float(), centroids), clusters.assignment)
    one_hot = torch.nn.functional.one_hot(clusters.assignment, 10).float()
    means = one_hot.transpose(-1, -2) @ keys / one_hot.sum(-2)[..., None].clamp_min(1)
    assert torch.allclose(means, centroids, atol=1e-4)


@pytest.mark.parametrize(
    "component",
    [
        {"clusterer": "kmeans"},
        {"clusterer": {"name": "position", "block_size": 20}},
        {"allocator": "mass"},
        {"allocator": "variance"},
        {"allocator": "uniform"},
    ],
)
@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_each_component_runs_in_a_pipeline_within_its_budget(component, gqa):
    keys, values, prefill, decode = make_inputs(batch=2, kv_heads=2, group=4, tokens=300, seed=5)
    pipe = oa.build(
        {
            "clusterer": {"name": "qgc", "num_clusters": 16},
            "sink": 4,
            "local": 16,
            "gqa": gqa,
            "budget": {"density": 0.1},
            **component,
        }
    )
    state = pipe.prepare(keys, values, prefill)
    state.append(keys[:, :, :5], values[:, :, :5])  # growth: tokens leaving the local window join a cluster
    out, stats = pipe.attend(decode, state, return_stats=True)
    budget = math.floor(0.1 * 305)
    assert torch.isfinite(out).all() and int(stats.reads.max()) == budget == int(stats.reads.min())
