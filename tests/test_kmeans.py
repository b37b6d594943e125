"""The k-means the clusterers share (oa_core.ops.kmeans): the torch code, and its Triton kernels under the
interpreter."""

import torch

from oa_core.ops.kmeans import lloyd, nearest


def test_lloyd_converges_to_a_fixed_point():
    gen = torch.Generator().manual_seed(0)
    points = torch.randn(2, 3, 500, 4, generator=gen)
    assignment, centroids = lloyd(
        points, torch.ones(points.shape[:-1], dtype=torch.bool), 10, iterations=100, generator=gen
    )
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
    assignment, _ = lloyd(
        points, torch.ones(1, 1, 400, dtype=torch.bool), 4, iterations=50, generator=torch.Generator().manual_seed(0)
    )
    # Same partition up to relabelling: each found cluster holds exactly one true label.
    pairs = set(zip(assignment.flatten().tolist(), labels.tolist()))
    assert len(pairs) == 4


def test_the_triton_kmeans_plus_plus_picks_the_torch_centres():
    """Under the interpreter: the one-launch k-means++ picks the torch code's centres, with masked points, blocks
    that do not divide the row, and a row with fewer points than centres (the fallback to its weights)."""
    import pytest

    from oa_core.ops import kmeans, triton_path

    if triton_path.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(triton_path.unavailable_reason(torch.device("cpu")))
    gen = torch.Generator().manual_seed(6)
    points = torch.randn(3, 150, 5, generator=gen)
    weight = (torch.rand(3, 150, generator=gen) > 0.3).float()
    weight[2] = 0
    weight[2, [7, 40, 90]] = 1  # three points, eight centres
    draws = torch.rand(8, 3, generator=gen, dtype=torch.float64)
    expected = kmeans.kmeans_plus_plus(points, weight, draws)
    assert torch.equal(kmeans.kmeans_plus_plus_triton(points, weight, draws, block_n=64), expected)
    assert {tuple(c.tolist()) for c in expected[2]} == {tuple(points[2, i].tolist()) for i in (7, 40, 90)}


def test_the_triton_nearest_centroid_matches_torch():
    """Under the interpreter: the nearest centroid equals the torch code's, the first of equal centroids winning
    across the kernel's tiles of 32."""
    import pytest

    from oa_core.ops import kmeans, triton_path

    if triton_path.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(triton_path.unavailable_reason(torch.device("cpu")))
    gen = torch.Generator().manual_seed(4)
    for r in (3, 16):
        points = torch.randn(3, 150, r, generator=gen)
        centroids = torch.randn(3, 37, r, generator=gen)
        centroids[:, 35] = centroids[:, 2]
        assert torch.equal(kmeans.nearest_triton(points, centroids, block_n=64), kmeans.nearest(points, centroids))


def test_the_triton_lloyd_iterations_equal_torchs(monkeypatch):
    """Under the interpreter: Lloyd's iterations as a GPU runs them (one launch each: only the points that changed
    cluster move their sums, the last program of a problem computes the next means, whether a point moved is flagged
    on the device) end where the torch loop ends after 0 to 6 iterations, asked after each or every 4: masked points,
    a block count that does not divide the row, an emptied cluster that keeps its centre."""
    import pytest

    from oa_core.ops import kmeans, triton_path

    if triton_path.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(triton_path.unavailable_reason(torch.device("cpu")))
    gen = torch.Generator().manual_seed(9)
    points = torch.randn(2, 300, 5, generator=gen)
    weight = (torch.rand(2, 300, generator=gen) > 0.25).float()
    centroids = points[:, :7].clone()
    centroids[1, 3] = 50.0  # nearest to no point: an emptied cluster from the start
    for iterations in (0, 1, 2, 3, 6):
        for check_every in (1, 4):
            expected = kmeans.lloyd_iterations(points, weight, centroids, iterations, check_every)
            with monkeypatch.context() as patch:
                patch.setattr(kmeans, "on_gpu", lambda tensor: True)
                assignment, means = kmeans.lloyd_iterations(points, weight, centroids, iterations, check_every)
            assert torch.equal(assignment, expected[0]), (iterations, check_every)
            assert torch.allclose(means, expected[1], atol=1e-5), (iterations, check_every)
            assert torch.equal(means[1, 3], centroids[1, 3])
    assert not torch.equal(expected[0], kmeans.nearest(points, centroids))  # the iterations moved points


def test_lloyd_on_the_triton_kernels_ends_where_torch_ends(monkeypatch):
    """Under the interpreter, Lloyd as it runs on a GPU (k-means++ in one launch, the nearest centroid in Triton, a
    look at the moved points every 4 iterations only) gives the torch code's clusters: converged, and stopped after
    3 iterations, before its first look."""
    import pytest

    from oa_core.ops import kmeans, triton_path

    if triton_path.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(triton_path.unavailable_reason(torch.device("cpu")))
    gen = torch.Generator().manual_seed(8)
    points = torch.randn(2, 3, 120, 4, generator=gen)
    mask = torch.rand(2, 3, 120, generator=gen) > 0.2
    for iterations in (40, 3):
        expected = kmeans.lloyd(points, mask, 6, iterations, torch.Generator().manual_seed(0))
        with monkeypatch.context() as patch:
            patch.setattr(kmeans, "on_gpu", lambda tensor: True)
            assignment, centroids = kmeans.lloyd(points, mask, 6, iterations, torch.Generator().manual_seed(0))
        assert torch.equal(assignment, expected[0])
        assert torch.allclose(centroids, expected[1], atol=1e-5)
        if iterations == 40:  # converged: a fixed point
            assert torch.equal(kmeans.nearest(points, centroids), assignment)
