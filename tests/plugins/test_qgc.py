import torch

from oa_plugins.clusterers.qgc import QGCConfig, QueryGeometryClusterer


def test_keys_that_differ_only_outside_the_query_subspace_share_a_cluster():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 1, 200, 8, generator=gen) * 5
    keys[..., 0] = torch.tensor([-10.0, 10.0]).repeat(100)  # the only axis queries see
    queries = torch.zeros(1, 1, 64, 8)
    queries[..., 0] = torch.randn(1, 1, 64, generator=gen)
    clusters = QueryGeometryClusterer(QGCConfig(num_clusters=2, rank=1)).fit(
        keys, queries, torch.ones(1, 200, dtype=torch.bool), torch.Generator().manual_seed(0)
    )
    assert clusters.assignment[0, 0, ::2].unique().numel() == 1
    assert clusters.assignment[0, 0, 1::2].unique().numel() == 1
    assert clusters.assignment[0, 0, 0] != clusters.assignment[0, 0, 1]


def test_new_keys_join_their_nearest_cluster():
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(1, 2, 300, 16, generator=gen)
    clusterer = QueryGeometryClusterer(QGCConfig(num_clusters=8, rank=4))
    clusters = clusterer.fit(keys, None, torch.ones(1, 300, dtype=torch.bool), torch.Generator().manual_seed(0))
    # A key equal to an existing one lands where that one is.
    assert torch.equal(clusterer.assign(clusters, keys[:, :, :20]), clusters.assignment[:, :, :20])


def test_fit_is_deterministic_for_a_seed():
    keys = torch.randn(2, 2, 256, 16, generator=torch.Generator().manual_seed(5))
    clusterer = QueryGeometryClusterer(QGCConfig(num_clusters=12))
    mask = torch.ones(2, 256, dtype=torch.bool)
    first = clusterer.fit(keys, None, mask, torch.Generator().manual_seed(7)).assignment
    second = clusterer.fit(keys, None, mask, torch.Generator().manual_seed(7)).assignment
    assert torch.equal(first, second)


def test_points_outside_the_mask_are_never_clustered():
    gen = torch.Generator().manual_seed(6)
    keys = torch.randn(2, 2, 100, 8, generator=gen)
    keys[0, :, :30] = 1e3  # padding with wild values must not pull any centre
    mask = torch.ones(2, 100, dtype=torch.bool)
    mask[0, :30] = False
    clusters = QueryGeometryClusterer(QGCConfig(num_clusters=5, rank=4)).fit(
        keys, None, mask, torch.Generator().manual_seed(0)
    )
    assert (clusters.assignment[0, :, :30] == 5).all()
    assert (clusters.assignment[mask[:, None].expand(2, 2, 100)] < 5).all()
    _, centroids = clusters.space
    assert centroids.abs().max() < 100


def _anisotropic_queries(gen, batch, heads, dim, window):
    """Prefill queries whose last ``window`` rows spread along axes 0-3 with variances 16 : 4 : 1 : 0.25 and whose
    earlier rows spread along the other axes: the metric depends on Λ_r and on taking only the window."""
    late = torch.randn(batch, heads, window, dim, generator=gen) * 0.05
    late[..., :4] = torch.randn(batch, heads, window, 4, generator=gen) * torch.tensor([4.0, 2.0, 1.0, 0.5])
    early = torch.randn(batch, heads, window, dim, generator=gen) * 0.05
    early[..., 4:8] = torch.randn(batch, heads, window, 4, generator=gen) * 6.0
    return torch.cat([early, late], dim=2)


def test_clusters_are_a_kmeans_fixed_point_in_the_query_metric():
    """Eq. 4 against the float64 reference (oa_core.testing.references): the assignment is a Lloyd fixed point of
    Φ = K U_r Λ_r^½, with U_r, Λ_r the top eigenpairs of the window's query second moment. The inputs are chosen so
    that the same check fails in the metric without Λ_r^½ and in the whole prefill's metric."""
    from oa_core.testing import references

    gen = torch.Generator().manual_seed(8)
    B, Hkv, g, N, D, r, C, window = 2, 2, 2, 400, 12, 4, 6, 64
    keys = torch.randn(B, Hkv, N, D, generator=gen)
    queries = _anisotropic_queries(gen, B, Hkv * g, D, window)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, :50] = False  # padding
    clusterer = QueryGeometryClusterer(QGCConfig(num_clusters=C, rank=r, query_window=window, iterations=300))
    assignment = clusterer.fit(keys, queries, mask, torch.Generator().manual_seed(0)).assignment
    metric = references.query_metric(queries, Hkv, r, window)
    points = keys.double() @ metric
    assert (references.lloyd_violations(points, assignment, C) == 0).all()
    # The check discriminates on these inputs: the same partition is no fixed point in the other metrics.
    unweighted = metric / metric.norm(dim=-2, keepdim=True)  # U_r alone
    whole = references.query_metric(queries, Hkv, r, 2 * window)
    for other in (unweighted, whole):
        assert (references.lloyd_violations(keys.double() @ other, assignment, C) > 0).any()
