"""The GPU selection path under Triton's interpreter: per-cluster top-q_b without sorting, and QGS scores from the
int8 codes, each against the torch reference."""

import math

import pytest
import torch

pytest.importorskip("triton")

from oa_core.components import Selector  # noqa: E402
from oa_core import selection  # noqa: E402
from oa_core.selection import cluster_members, select_per_cluster  # noqa: E402
from oa_plugins.selectors.qgs import int8_scores, quantize  # noqa: E402


def test_cluster_members_lists_each_cluster_in_position_order():
    assignment = torch.tensor([[[3, 0, 2, 0, 1, 3, 0, 2]]])  # 3 = outside the clusters
    members, counts = cluster_members(assignment, 3)
    assert counts.tolist() == [[[3, 1, 2]]]
    assert members.tolist() == [[[[1, 3, 6], [4, -1, -1], [2, 7, -1]]]]


@pytest.mark.parametrize("register_limit", [8192, 16], ids=["in registers", "a block at a time"])
def test_per_cluster_selection_matches_the_reference_set(register_limit, monkeypatch):
    monkeypatch.setattr(selection, "REGISTER_LIMIT", register_limit)
    gen = torch.Generator().manual_seed(0)
    B, H, Gs, T, N, C = 2, 2, 2, 1, 90, 4
    assignment = torch.randint(C, (B, H, N), generator=gen)
    assignment[..., :4] = C  # sink
    assignment[..., -8:] = C  # local window
    scores = torch.randn(B, H, Gs, T, N, generator=gen).masked_fill((assignment == C)[:, :, None, None], -math.inf)
    scores[0, 0, 0, 0, 10:30] = 0.5  # ties across a cluster boundary: broken by position
    scores[1, 1] = -scores[1, 1].abs()  # negative scores only
    members, counts = cluster_members(assignment, C)
    quotas = torch.minimum(torch.randint(0, 9, (B, H, Gs, T, C), generator=gen), counts[:, :, None, None])
    quotas[0, 1, 0, 0] = counts[0, 1]  # whole clusters
    quotas[1, 0, 1, 0] = 0  # nothing
    width = int(quotas.sum(-1).max()) + 2
    fast = select_per_cluster(scores, members, counts, quotas, width)
    reference = Selector.select(None, scores, assignment, quotas, width)
    assert fast.shape == reference.shape
    assert torch.equal(fast.sort(-1).values, reference.sort(-1).values)
    assert bool(((fast >= 0).sum(-1) == quotas.sum(-1)).all())


def test_int8_scores_match_the_reference():
    gen = torch.Generator().manual_seed(1)
    B, H, Q, N, r = 2, 2, 6, 150, 16
    codes, scales = quantize(torch.randn(B, H, N, r, generator=gen) * 3)
    projected = torch.randn(B, H, Q, r, generator=gen)
    fast = int8_scores(projected, codes, scales, 0.125)
    reference = (projected @ codes.float().transpose(-1, -2)) * (0.125 * scales[:, :, None, :])
    assert torch.allclose(fast, reference, rtol=1e-5, atol=1e-5)
