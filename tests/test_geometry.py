"""The query geometry and k-means the clusterers share (oa_core.geometry)."""

import torch

from oa_core.geometry import lloyd, nearest, query_geometry


def test_lloyd_converges_to_a_fixed_point():
    gen = torch.Generator().manual_seed(0)
    points = torch.randn(2, 3, 500, 4, generator=gen)
    assignment, centroids = lloyd(points, torch.ones(points.shape[:-1], dtype=torch.bool), 10, iterations=100,
                                  generator=gen)
    # Every point is nearest its own centroid, and every centroid is its members' mean.
    assert torch.equal(nearest(points, centroids), assignment)
    one_hot = torch.nn.functional.one_hot(assignment, 10).float()
    means = one_hot.transpose(-1, -2) @ points / one_hot.sum(-2)[..., None].clamp_min(1)
    assert torch.allclose(means, centroids, atol=1e-5)


def test_separated_blobs_are_recovered():
    gen = torch.Generator().manual_seed(1)
    centres = torch.tensor([[0.0, 0], [20, 0], [0, 20], [20, 20]])
    labels = torch.arange(400) % 4
    points = (centres[labels] + torch.randn(400, 2, generator=gen)).view(1, 1, 400, 2)
    assignment, _ = lloyd(points, torch.ones(1, 1, 400, dtype=torch.bool), 4, iterations=50,
                          generator=torch.Generator().manual_seed(0))
    # Same partition up to relabelling: each found cluster holds exactly one true label.
    pairs = set(zip(assignment.flatten().tolist(), labels.tolist()))
    assert len(pairs) == 4


def test_query_geometry_finds_the_query_subspace():
    gen = torch.Generator().manual_seed(2)
    queries = torch.zeros(1, 2, 100, 8)
    queries[..., :2] = torch.randn(1, 2, 100, 2, generator=gen) * torch.tensor([3.0, 1.0])
    basis, eigenvalues = query_geometry(torch.randn(1, 1, 50, 8, generator=gen), queries, torch.ones(1, 50, dtype=torch.bool),
                                        rank=2, window=100)
    # Both query heads share the KV head: the basis spans the first two axes, largest variance first.
    assert basis[0, 0, 2:].abs().max() < 1e-6  # nothing outside the span of the queries
    assert torch.allclose(basis[0, 0].T @ basis[0, 0], torch.eye(2), atol=1e-5)
    assert basis[0, 0, 0, 0].abs() > 0.99  # the wider query axis comes first
    assert eigenvalues[0, 0, 0] > eigenvalues[0, 0, 1] > 0
