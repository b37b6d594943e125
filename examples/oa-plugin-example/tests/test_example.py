"""The example plugin's components against OpenAttention's conformance kit, and their own defining properties."""

import pytest
import torch

import oa_core as oa
from oa_core.testing import check_component
from oa_plugin_example import (Float64Kernel, KeyNormSelector, ProportionalAllocator, RandomClusterer)

COMPONENTS = [("clusterer", RandomClusterer), ("selector", KeyNormSelector), ("allocator", ProportionalAllocator),
              ("kernel", Float64Kernel)]


@pytest.mark.parametrize("kind, component", COMPONENTS, ids=[k for k, _ in COMPONENTS])
def test_conforms(kind, component):
    # pipeline=True also runs it inside a pipeline by name: the package must be installed (pip install -e .).
    check_component(kind, component)


def test_proportional_quotas_follow_cluster_sizes():
    counts = torch.tensor([10.0, 30.0, 60.0]).view(1, 1, 3)
    inputs = oa.AllocationInput(torch.zeros(1, 1, 1, 1, 3), torch.zeros(1, 1, 1, 1, 3), counts,
                                torch.zeros(1, 1, 1, 1, 8), torch.zeros(1, 1, 8, dtype=torch.long),
                                torch.tensor(20).view(1, 1, 1, 1))
    assert ProportionalAllocator().allocate(inputs).flatten().tolist() == [2, 6, 12]


def test_key_norm_ignores_the_query():
    keys = torch.randn(1, 2, 50, 16)
    selector = KeyNormSelector()
    index = selector.build(keys, None, None)
    a = selector.score(oa.group_queries(torch.randn(1, 4, 1, 16), 2, shared=False), index, keys, 0.25)
    b = selector.score(oa.group_queries(torch.randn(1, 4, 1, 16), 2, shared=False), index, keys, 0.25)
    assert torch.equal(a, b) and torch.equal(a[0, 0, 0, 0], keys[0, 0].norm(dim=-1))
