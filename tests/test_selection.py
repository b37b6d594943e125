"""The GPU selection path under Triton's interpreter, the CPU's compiled one: per-cluster top-q_b without sorting,
and QGS scores from the int8 codes, each against the torch reference."""

import math
import warnings

import pytest
import torch

pytest.importorskip("triton")

import itertools

from oa_core.ops import selection
from oa_core.ops.selection import (
    cluster_members,
    select_by_sorting,
    select_per_cluster,
    size_classes,
)
from oa_plugins.selectors.qgs import group_int8_scores, quantize


def test_cluster_members_lists_each_cluster_in_position_order():
    assignment = torch.tensor([[[3, 0, 2, 0, 1, 3, 0, 2]]])  # 3 = outside the clusters
    members, counts = cluster_members(assignment, 3)
    assert counts.tolist() == [[[3, 1, 2]]]
    assert members.tolist() == [[[[1, 3, 6], [4, -1, -1], [2, 7, -1]]]]


@pytest.mark.parametrize("register_limit", [8192, 16], ids=["in registers", "a block at a time"])
def test_per_cluster_selection_matches_the_reference(register_limit, monkeypatch):
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
    reference = select_by_sorting(scores, assignment, quotas, width)
    assert torch.equal(fast, reference)
    assert bool(((fast >= 0).sum(-1) == quotas.sum(-1)).all())


def test_selection_reads_a_grown_member_table(monkeypatch):
    """After decode growth the member table is a view with a spare slot per (batch row, head) — not contiguous —
    and the kernel must read every head's clusters where they are (a head read at a contiguous offset misses its
    clusters' last members)."""
    from oa_core.ops.selection import add_members

    gen = torch.Generator().manual_seed(1)
    B, H, Gs, T, N, C = 2, 3, 2, 1, 120, 5
    assignment = torch.randint(C, (B, H, N), generator=gen)
    assignment[..., -12:] = C  # rows that join their clusters by growth
    members, counts = cluster_members(assignment, C, room=16)
    grown = torch.randint(C + 1, (B, H, 12), generator=gen)  # C: stays outside
    members, counts = add_members(members, counts, grown, torch.arange(N - 12, N))
    assert not members.is_contiguous()
    assignment[..., -12:] = grown
    scores = torch.randn(B, H, Gs, T, N, generator=gen).masked_fill((assignment == C)[:, :, None, None], -math.inf)
    scores[..., -12:] += 3.0  # the newest members are the best: a head read at the wrong offset loses them
    quotas = torch.minimum(torch.randint(1, 4, (B, H, Gs, T, C), generator=gen), counts[:, :, None, None])
    width = int(quotas.sum(-1).max())
    fast = select_per_cluster(scores, members, counts, quotas, width)
    reference = select_by_sorting(scores, assignment, quotas, width)
    assert torch.equal(fast, reference)


def test_size_classes_cover_every_cluster_size_once():
    assert size_classes(1) == [(0, 1024, 1024)]
    assert size_classes(3000) == [(0, 1024, 1024), (1024, 4096, 4096)]
    assert size_classes(5000) == [(0, 1024, 1024), (1024, 4096, 4096), (4096, 5000, 4096)]
    for largest in (1, 511, 512, 513, 4096, 4097, 10000):
        classes = size_classes(largest)
        assert classes[0][0] == 0 and classes[-1][1] >= largest
        assert all(a[1] == b[0] for a, b in itertools.pairwise(classes))  # contiguous, not overlapping
    assert size_classes(3000, small=256) == [(0, 512, 512), (512, 2048, 2048), (2048, 4096, 4096)]


@pytest.mark.parametrize("typical", [1, 15.2, 16, 17, 254.9, 255, 256, 257, 511, 512, 513, 3000])
def test_the_smallest_block_holds_a_typical_cluster(typical):
    """The power of two at or above the typical size (its smaller path holds a typical cluster), within [16,
    SMALL_CLUSTER]."""
    block = selection.smallest_block(typical)
    assert block & (block - 1) == 0 and 16 <= block <= selection.SMALL_CLUSTER
    assert block >= typical or block == selection.SMALL_CLUSTER
    assert block // 2 < typical or block == 16


@pytest.mark.parametrize("few", [16, 2], ids=["picks", "bisection"])
def test_every_size_class_matches_the_reference_layout(few, monkeypatch):
    """Classes (0, 8] (paths of 4 and 8 lanes), (8, 16] in registers and (16, 40] a block at a time, over ragged
    clusters (one empty), with quotas 0, 1, n - 1, n and random, ties (across clusters, ±0) and negative scores; quotas
    above ``few`` by bisection, the others picked one at a time."""
    monkeypatch.setattr(selection, "FEW_PICKS", few)
    monkeypatch.setattr(selection, "SMALL_CLUSTER", 4)
    monkeypatch.setattr(selection, "REGISTER_LIMIT", 16)
    gen = torch.Generator().manual_seed(2)
    sizes = torch.tensor([1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 40, 0])
    C = len(sizes)
    B, H, Gs, T = 2, 2, 2, 1
    N = 4 + int(sizes.sum()) + 6
    inside = torch.repeat_interleave(torch.arange(C), sizes)
    assignment = torch.full((B, H, N), C)
    for b in range(B):
        for h in range(H):
            assignment[b, h, 4:-6] = inside[torch.randperm(len(inside), generator=gen)]
    members, counts = cluster_members(assignment, C)
    assert [low for low, _, _ in size_classes(members.shape[-1])] == [0, 8, 16]
    scores = torch.randn(B, H, Gs, T, N, generator=gen)
    scores[0, 0, 0] = torch.randint(-2, 3, (T, N), generator=gen).float()  # many ties
    scores[0, 1, 1] = torch.tensor([0.0, -0.0])[torch.randint(2, (T, N), generator=gen)]  # ±0 tie
    scores[1, 0] = -scores[1, 0].abs() - 1e3  # negative scores only
    scores[1, 1, 0] = 0.25  # everything tied
    scores = scores.masked_fill((assignment == C)[:, :, None, None], -math.inf)
    n = counts[:, :, None, None].expand(B, H, Gs, T, C)
    draw = (torch.rand(B, H, Gs, T, C, generator=gen) * (n + 1)).long().clamp(max=n)
    pick = torch.randint(5, (B, H, Gs, T, C), generator=gen)  # 0, 1, n - 1, n, random
    quotas = torch.stack([torch.zeros_like(n), n.clamp(max=1), (n - 1).clamp_min(0), n, draw], -1)
    quotas = quotas.gather(-1, pick[..., None]).squeeze(-1)
    quotas[0, 0, 0] = n[0, 0, 0].clamp(max=2)  # the best one or two of ties
    quotas[1, 1, 1] = draw[1, 1, 1]
    width = int(quotas.sum(-1).max()) + 3
    fast = select_per_cluster(scores, members, counts, quotas, width)
    reference = select_by_sorting(scores, assignment, quotas, width)
    assert torch.equal(fast, reference)
    assert bool(((fast >= 0).sum(-1) == quotas.sum(-1)).all())


@pytest.mark.parametrize("few", [16, 1])
@pytest.mark.parametrize("size", [3, 7, 12, 30])
def test_ties_at_the_top_are_taken_in_position_order(size, few, monkeypatch):
    """One cluster (of each size class below), its best score held by every other position, quotas below that
    count: exactly the first ones, nothing written past the quota (no later cluster's slot to hide it)."""
    monkeypatch.setattr(selection, "FEW_PICKS", few)
    monkeypatch.setattr(selection, "SMALL_CLUSTER", 4)
    monkeypatch.setattr(selection, "REGISTER_LIMIT", 16)
    assignment = torch.zeros(1, 1, size, dtype=torch.long)
    members, counts = cluster_members(assignment, 1)
    scores = torch.where(torch.arange(size) % 2 == 0, 3.0, -torch.arange(size).float()).expand(1, 1, 1, 3, size)
    quotas = torch.tensor([1, 2, size - 1]).view(1, 1, 1, 3, 1)
    fast = select_per_cluster(scores, members, counts, quotas, size)
    reference = select_by_sorting(scores, assignment, quotas, size)
    assert torch.equal(fast, reference)


def test_int8_scores_match_the_reference():
    gen = torch.Generator().manual_seed(1)
    B, H, Q, N, r = 2, 2, 6, 150, 16
    codes, scales = quantize(torch.randn(B, H, N, r, generator=gen) * 3)
    projected = torch.randn(B, H, Q, r, generator=gen)
    fast = group_int8_scores(projected, codes, scales, 0.125, Q, 1).view(B, H, Q, N)  # each row its own group
    reference = (projected @ codes.float().transpose(-1, -2)) * (0.125 * scales[:, :, None, :])
    assert torch.allclose(fast, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, k", [(1, 1), (37, 5), (300, 300), (4096, 492), (500, 600), (50, 0)])
@pytest.mark.parametrize("fewer", [False, True])
def test_best_of_is_a_stable_descending_sort_cut_at_k(n, k, fewer):
    """Ties (rounded scores, equal pages), -inf, and -0.0 beside 0.0: the set of the first k columns of a stable
    descending sort, with the same scores, and each row's first ``counts`` marked (every row k, the unsorted path;
    or some rows fewer, the sorted one)."""
    from oa_core.ops.selection import best_of

    gen = torch.Generator().manual_seed(n)
    scores = (torch.randn(2, 3, 2, 1, n, generator=gen) * 4).round() / 2  # many ties
    scores[0, 0, 0, 0, : n // 3] = float("-inf")
    scores[1, 1, 1, 0, ::3] = -0.0
    scores[1, 1, 1, 0, 1::3] = 0.0
    kept_k = min(k, n)
    counts = torch.full((2, 3, 1, 1, 1), kept_k)
    if fewer:
        counts[1, 2] = max(kept_k // 3, 1)
        counts[0, 1] = 0
    values, positions, kept = best_of(scores, k, counts)
    expected_values, expected_positions = (t[..., :kept_k] for t in scores.sort(dim=-1, descending=True, stable=True))
    order = positions.argsort(-1)  # compared as sets: by position
    assert torch.equal(positions.gather(-1, order), expected_positions.sort(-1).values)
    assert torch.equal(values, scores.gather(-1, positions))
    rank = torch.arange(kept_k)
    expected_kept = (rank < counts) & (expected_values > float("-inf"))
    marked = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, positions, kept)
    expected_marked = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, expected_positions, expected_kept)
    assert torch.equal(marked, expected_marked)


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_cpu_selection_lists_what_select_by_sorting_lists(seed):
    """The CPU's path (``oa_core.ops.native``, compiled at first use) against the sorting reference, position for
    position: ties, -inf, ragged clusters and positions outside every cluster; quotas a row's best rows fill and
    quotas of low-scored clusters, whole clusters, none; widths that cut a row, and wider than the context and than
    the member table; the member table as growth leaves it (a view with a spare slot per head)."""
    from oa_core.ops import native
    from oa_core.ops.selection import add_members, select, top_counts

    if native._compiler() is None and native.library() is None:
        pytest.skip("no C++ compiler here: select runs its torch reference (test_select_without_the_compiled_path)")
    assert native.unavailable_reason() is None  # a compiler is here: the library builds
    gen, scores, assignment, members, counts = _ragged_case(seed)
    B, H, Gs, T, N = scores.shape
    C = counts.shape[-1]
    scores[0, 0, 0, 0] = float("-inf")  # a row of -inf only
    quotas = top_counts(scores, assignment, torch.full((B, H, 1, 1), 40), C, 40)  # a row's best
    quotas[1, :, 1, :, 3] = torch.minimum(quotas[1, :, 1, :, 3] + 25, counts[1, :, None, 3])  # more than its best
    quotas[0, 1, 2, 1, 2] = counts[0, 1, 2]  # a whole cluster
    random = (torch.rand(B, H, Gs, T, C, generator=gen) * (counts[:, :, None, None] + 1)).floor().long()
    for q in (quotas, random, torch.zeros_like(quotas)):
        least = int(q.sum(-1).max())
        for w in (max(least - 7, 1), least, N + 5, C * members.shape[-1] + 5):
            fast = select(scores, assignment, q, w, (members, counts))
            assert torch.equal(fast, native.select_per_cluster(scores, members, counts, q, w))  # the path taken
            assert torch.equal(fast, select_by_sorting(scores, assignment, q, w)), w
    # Growth's table: positions N.. joined clusters 1 and 5 (a view of a buffer with a spare slot per head).
    ids = torch.tensor([1, 5]).expand(B, H, 2)
    grown, grown_counts = add_members(cluster_members(assignment, C, room=2)[0], counts, ids, torch.arange(N, N + 2))
    assert not grown.is_contiguous()
    wider = torch.cat([scores, torch.randn(B, H, Gs, T, 2, generator=gen)], dim=-1)
    grown_assignment = torch.cat([assignment, ids], dim=-1)
    q = (torch.rand(B, H, Gs, T, C, generator=gen) * (grown_counts[:, :, None, None] + 1)).floor().long()
    assert torch.equal(
        native.select_per_cluster(wider, grown, grown_counts, q, 60), select_by_sorting(wider, grown_assignment, q, 60)
    )


def test_select_without_the_compiled_path_runs_the_reference_and_says_so(monkeypatch):
    from oa_core.ops import native
    from oa_core.ops.selection import select

    _, scores, assignment, members, counts = _ragged_case(0)
    quotas = (counts[:, :, None, None] // 2).expand(*scores.shape[:-1], -1).contiguous()
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_reason", "no C++ compiler found")
    monkeypatch.setattr(native, "_warned", False)
    with pytest.warns(
        RuntimeWarning,
        match=r"compiled selection is unavailable \(no C\+\+ compiler found\); the "
        "torch reference runs instead",
    ):
        got = select(scores, assignment, quotas, 200, (members, counts))
    assert torch.equal(got, select_by_sorting(scores, assignment, quotas, 200))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        select(scores, assignment, quotas, 200, (members, counts))


def _ragged_case(seed: int):
    """(generator, scores [2, 2, 3, 2, 300] with many ties, -inf outside the clusters, assignment to 7 ragged
    clusters with 10 positions outside every cluster, its member table and counts)."""
    gen = torch.Generator().manual_seed(seed)
    B, H, Gs, T, N, C = 2, 2, 3, 2, 300, 7
    scores = (torch.randn(B, H, Gs, T, N, generator=gen) * 3).round()  # many ties
    assignment = torch.randint(C, (B, H, N), generator=gen)
    assignment[..., :10] = C  # outside every cluster
    scores = scores.masked_fill(assignment[:, :, None, None] == C, float("-inf"))
    members, counts = cluster_members(assignment, C)
    return gen, scores, assignment, members, counts
