import torch

from oa_core.components import AllocationInput
from oa_core.ops.selection import select_by_sorting
from oa_plugins.allocators.global_topk import GlobalTopK


def test_per_cluster_selection_takes_each_clusters_best():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 2, 3, 4, 50, generator=gen)
    assignment = torch.randint(5, (2, 2, 50), generator=gen)
    assignment[..., :3] = 5  # outside the clusterable region
    scores = scores.masked_fill((assignment == 5)[:, :, None, None], float("-inf"))
    quotas = torch.randint(0, 4, (2, 2, 3, 4, 5), generator=gen)
    sizes = torch.nn.functional.one_hot(assignment, 6)[..., :5].sum(2)[:, :, None, None]
    quotas = torch.minimum(quotas, sizes)
    chosen = select_by_sorting(scores, assignment, quotas)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in scores.shape[:4])).tolist():
        row, picks = scores[tuple(idx)], chosen[tuple(idx)]
        picks = picks[picks >= 0]
        for cluster in range(5):
            members = (assignment[idx[0], idx[1]] == cluster).nonzero().flatten()
            best = members[row[members].argsort(descending=True)[: int(quotas[tuple(idx)][cluster])]]
            assert set(picks[assignment[idx[0], idx[1]][picks] == cluster].tolist()) == set(best.tolist())
        assert len(picks) == int(quotas[tuple(idx)].sum())


def test_global_quotas_select_the_global_top_k():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(1, 2, 2, 3, 80, generator=gen)
    assignment = torch.randint(6, (1, 2, 80), generator=gen)
    counts = torch.nn.functional.one_hot(assignment, 6).sum(2).float()
    inputs = AllocationInput(
        torch.zeros(1, 2, 2, 3, 6),
        torch.zeros(1, 2, 2, 3, 6),
        counts,
        scores,
        assignment,
        torch.tensor([17, 9]).view(1, 2, 1, 1),
    )
    quotas = GlobalTopK().allocate(inputs)
    assert (quotas[:, 0].sum(-1) == 17).all() and (quotas[:, 1].sum(-1) == 9).all()  # each KV head its own budget
    chosen = select_by_sorting(scores, assignment, quotas)
    assert torch.equal(chosen[:, 0].sort(-1).values, scores[:, 0].topk(17, dim=-1).indices.sort(-1).values)
    top9 = scores[:, 1].topk(9, dim=-1).indices.sort(-1).values
    assert torch.equal(chosen[:, 1, ..., :9].sort(-1).values, top9) and (chosen[:, 1, ..., 9:] == -1).all()
