"""The float64 references (oa_core.testing.references) on cases worked out by hand: the tests that rely on them are only
as right as they are."""

import math

import torch

from oa_core.components import PooledClusters, Selection
from oa_core.ops.scatter import pooled_sums
from oa_core.testing import references
from oa_plugins.kernels.reference import TorchKernel


def test_proxy_attention_reading_every_row_is_softmax_attention():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 20, 8, generator=gen), torch.randn(1, 2, 20, 8, generator=gen)
    query = torch.randn(1, 4, 2, 8, generator=gen)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double(), keys.double().repeat_interleave(2, 1), values.double().repeat_interleave(2, 1), scale=0.4
    )
    everything = torch.arange(20).expand(1, 2, 1, 2, 20)
    assignment = torch.randint(3, (1, 2, 20), generator=gen)
    for index in (None, everything):  # every row read: no tail, no proxy
        got = references.proxy_attention(query, keys, values, index, assignment, 3, 0.4)
        assert torch.allclose(got, expected, atol=1e-12)


def test_a_proxy_is_the_tails_mean_key_and_value_weighted_by_its_count():
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0], [0.0, 2.0]]).view(1, 1, 4, 2)
    values = torch.eye(4)[:, :2].contiguous().view(1, 1, 4, 2) + torch.tensor([0.0, 5.0])
    query = torch.tensor([1.0, 1.0]).view(1, 1, 1, 2)
    index = torch.tensor([0, -1]).view(1, 1, 1, 1, 2)  # row 0 read, then padding
    assignment = torch.tensor([2, 0, 0, 1]).view(1, 1, 4)  # rows 1, 2 in cluster 0; row 3 alone in cluster 1
    got = references.proxy_attention(query, keys, values, index, assignment, 2, 1.0).flatten()
    terms = [(0.0, values[0, 0, 0]), (2.0 + math.log(2), values[0, 0, 1:3].mean(0)), (2.0, values[0, 0, 3])]
    weights = torch.softmax(torch.tensor([t[0] for t in terms], dtype=torch.float64), 0)
    assert torch.allclose(got, sum(w * v.double() for w, (_, v) in zip(weights, terms)))


def test_cluster_statistics_from_the_members():
    keys = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 5.0]]).view(1, 1, 3, 2)
    query = torch.tensor([2.0, -1.0]).view(1, 1, 1, 2)
    mean, var = references.cluster_logit_stats(query, keys, torch.tensor([[[0, 0, 1]]]), 2, 0.5)
    assert torch.allclose(mean.flatten(), torch.tensor([0.5 * (2 * 2 - 1), 0.5 * (2 * 5 - 5)], dtype=torch.float64))
    # Var of cluster 0: (1, 1) per dim; σ² = s²(4·1 + 1·1); cluster 1 has one member: 0.
    assert torch.allclose(var.flatten(), torch.tensor([0.25 * 5, 0.0], dtype=torch.float64))


def test_water_filling_worked_example():
    capacity = torch.tensor([100.0, 100.0, 100.0, 2.0])
    ideal = references.water_fill(torch.log(torch.tensor([4.0, 2.0, 1.0, 8.0])), capacity, 30)
    # Cluster 3 is full at 2; the other 28 split 4 : 2 : 1.
    assert torch.allclose(ideal, torch.tensor([16.0, 8.0, 4.0, 2.0], dtype=torch.float64))
    zero_last = references.water_fill(torch.tensor([0.0, -math.inf, -math.inf]), torch.tensor([3.0, 10.0, 30.0]), 11)
    assert torch.allclose(zero_last, torch.tensor([3.0, 2.0, 6.0], dtype=torch.float64))  # then by size


def test_rounding_violations_tell_largest_from_smallest_remainders():
    ideal = torch.tensor([[1.7, 1.2, 0.1]], dtype=torch.float64)  # Σ = 3
    capacity = torch.tensor([5.0, 5.0, 5.0])
    assert not references.rounding_violations(torch.tensor([[2, 1, 0]]), ideal, capacity).any()
    assert references.rounding_violations(torch.tensor([[1, 2, 0]]), ideal, capacity).all()  # 1.2 up before 1.7
    assert references.rounding_violations(torch.tensor([[3, 0, 0]]), ideal, capacity).all()  # not ⌊x⌋ or ⌈x⌉
    assert references.rounding_violations(torch.tensor([[2, 1, 1]]), ideal, capacity).all()  # sums to 4


def test_errorgate_priority_is_eq6_over_z_hat():
    z, var, n = [0.3, -1.0], [1.7, 0.4], [12.0, 5.0]
    mass = [n[b] * math.exp(z[b] + var[b] / 2) for b in range(2)]
    error = [mass[b] * math.erf(math.sqrt(var[b]) / math.sqrt(2)) for b in range(2)]  # 2Φ(σ) − 1 = erf(σ/√2)
    got = references.errorgate_priority(
        torch.tensor(z).view(1, 1, 1, 1, 2),
        torch.tensor(var).view(1, 1, 1, 1, 2),
        torch.tensor(n).view(1, 1, 2),
        shared=False,
    )
    assert torch.allclose(got.exp().flatten(), torch.tensor([e / sum(mass) for e in error], dtype=torch.float64))


def test_query_metric_of_axis_aligned_queries():
    gen = torch.Generator().manual_seed(1)
    queries = torch.zeros(1, 2, 4000, 4)
    queries[..., 1] = torch.randn(1, 2, 4000, generator=gen) * 3
    queries[..., 2] = torch.randn(1, 2, 4000, generator=gen)
    projection = references.query_metric(queries, 1, 2, 4000)[0, 0]
    # Columns ±√λ e_1 and ±√λ e_2 with λ the second moments (about 9 and 1), the largest first.
    assert torch.allclose(
        projection.abs(), torch.tensor([[0.0, 0], [3, 0], [0, 1], [0, 0]], dtype=torch.float64), atol=0.1
    )


def test_lloyd_violations_count_points_nearer_another_mean():
    points = torch.tensor([[0.0], [1.0], [10.0], [11.0], [5.0]]).view(1, 5, 1)
    assert int(references.lloyd_violations(points, torch.tensor([[0, 0, 1, 1, 2]]), 2)) == 0  # id 2: outside
    assert int(references.lloyd_violations(points, torch.tensor([[0, 1, 1, 1, 2]]), 2)) == 1  # 1.0 is nearer 0.0


def test_the_int8_bound_holds_and_is_reached():
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 1, 500, 6, generator=gen)
    query = torch.randn(1, 1, 1, 6, generator=gen)
    basis = torch.eye(6)[:, :3].view(1, 1, 6, 3)
    exact, bound = references.qgs_error_bound(query, keys, basis, 0.5)
    projected = keys[0, 0, :, :3].double()
    step = projected.abs().amax(-1, keepdim=True) / 127
    coded = torch.round(projected / step) * step  # symmetric int8, written out
    approx = 0.5 * coded @ query[0, 0, 0, :3].double()
    error = (approx - exact.flatten()).abs()
    assert (error <= bound.flatten() + 1e-12).all() and (error > 0.3 * bound.flatten()).any()


def test_a_second_order_proxy_adds_the_log_of_one_plus_half_the_tails_logit_variance():
    # The same case as above: nothing of cluster 0 (rows 1, 2: keys (1, 0) and (3, 0), logits 1 and 3) is read, so its
    # tail's logit variance is the cluster's, 1, and its logit gains ln 1.5; cluster 1's one row has none: ln 1 = 0.
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0], [0.0, 2.0]]).view(1, 1, 4, 2)
    values = torch.eye(4)[:, :2].contiguous().view(1, 1, 4, 2) + torch.tensor([0.0, 5.0])
    query = torch.tensor([1.0, 1.0]).view(1, 1, 1, 2)
    assignment = torch.tensor([2, 0, 0, 1]).view(1, 1, 4)

    def expected(terms):
        weights = torch.softmax(torch.tensor([t[0] for t in terms], dtype=torch.float64), 0)
        return sum(w * v.double() for w, (_, v) in zip(weights, terms))

    index = torch.tensor([0, -1]).view(1, 1, 1, 1, 2)
    got = references.proxy_attention(query, keys, values, index, assignment, 2, 1.0, second_order=True).flatten()
    assert torch.allclose(
        got,
        expected(
            [
                (0.0, values[0, 0, 0]),
                (2.0 + math.log(2) + math.log(1.5), values[0, 0, 1:3].mean(0)),
                (2.0, values[0, 0, 3]),
            ]
        ),
    )
    # Row 1 read too: cluster 0's tail is row 2 alone, (Σ_b z² − z_1²)/1 − z_2² = (1 + 9 − 1) − 9 = 0: no term.
    index = torch.tensor([0, 1]).view(1, 1, 1, 1, 2)
    got = references.proxy_attention(query, keys, values, index, assignment, 2, 1.0, second_order=True).flatten()
    assert torch.allclose(
        got, expected([(0.0, values[0, 0, 0]), (1.0, values[0, 0, 1]), (3.0, values[0, 0, 2]), (2.0, values[0, 0, 3])])
    )


def test_the_tails_logit_variance_is_bounded_by_its_gap_to_the_least_logit_read():
    # One cluster, logits 0, 2, 4, 2.5 (keys along the query's first axis: the diagonal variance is exact). Read the
    # row at 2.5: the tail {0, 2, 4} has mean 2 and variance 8/3, bounded by (2.5 − 2)² = 0.25. Read the row at 4:
    # the tail {0, 2, 2.5} (mean 1.5, variance 7/6) lies well below it, (4 − 1.5)² = 6.25, no bound. Read the row
    # at 0: it lies below the tail's mean, 17/6, and the bound leaves the mean proxy.
    keys = torch.tensor([[0.0, 0.0], [2.0, 0.0], [4.0, 0.0], [2.5, 0.0]]).view(1, 1, 4, 2)
    values = torch.randn(1, 1, 4, 2, generator=torch.Generator().manual_seed(0))
    query = torch.tensor([1.0, 1.0]).view(1, 1, 1, 2)
    assignment = torch.zeros(1, 1, 4, dtype=torch.long)
    for read, tail_mean, term in ((3, 2.0, math.log(1.125)), (2, 1.5, math.log(1 + 7 / 12)), (0, 17 / 6, 0.0)):
        tail = [row for row in range(4) if row != read]
        weights = torch.softmax(
            torch.tensor([float(keys[0, 0, read, 0]), tail_mean + math.log(3) + term], dtype=torch.float64), 0
        )
        expected = weights[0] * values[0, 0, read].double() + weights[1] * values[0, 0, tail].double().mean(0)
        index = torch.tensor([read]).view(1, 1, 1, 1, 1)
        got = references.proxy_attention(query, keys, values, index, assignment, 1, 1.0, second_order=True)
        assert torch.allclose(got.flatten(), expected), read
        count, key_sum, value_sum, key_square_sum = pooled_sums(assignment, keys, values, 1)
        proxies = PooledClusters(count, key_sum, value_sum, assignment, key_square_sum, second_order=True)
        out, _ = TorchKernel().attend(query, keys, values, Selection(index, torch.zeros(index.shape)), proxies, 1.0)
        assert torch.allclose(out.flatten().double(), expected, atol=1e-6), read
