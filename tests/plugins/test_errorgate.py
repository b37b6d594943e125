import math

import pytest
import torch

from oa_core.components import AllocationInput
from oa_plugins.allocators.errorgate import ErrorGate, log_error_estimate

# The paper's ErrorGate (Eqs. 6–7, no floor): what the tests of the water-filling hold; the floor's have their own.
PAPER = ErrorGate.Config(floor=0.0)


def allocation(mean_logit, logit_var, counts, budget, shared=False):
    """AllocationInput for one batch row and KV head, one query: [C] tensors."""
    shape = (1, 1, 1, 1, -1)
    scores = torch.zeros(1, 1, 1, 1, int(counts.sum()))
    return AllocationInput(
        mean_logit.view(shape),
        logit_var.view(shape),
        counts.view(1, 1, -1),
        scores,
        torch.zeros(1, 1, int(counts.sum()), dtype=torch.long),
        torch.tensor(budget).view(1, 1, 1, 1),
    )


def test_quotas_are_monotone_in_the_estimated_error():
    counts = torch.full((40,), 50.0)
    mean_logit = torch.linspace(-3, 3, 40)
    logit_var = torch.full((40,), 0.5)
    quotas = ErrorGate(PAPER).allocate(allocation(mean_logit, logit_var, counts, 300)).flatten()
    log_error, _ = log_error_estimate(mean_logit, logit_var, counts)
    order = log_error.argsort()
    assert (quotas[order].diff() >= 0).all()
    assert quotas[-1] > quotas[0]


def test_extreme_logits_do_not_overflow():
    counts = torch.full((8,), 20.0)
    mean_logit = torch.tensor([1e4, -1e4, 9990.0, 0.0, 1e4, -5e3, 3.0, 9999.0])
    logit_var = torch.tensor([1.0, 4.0, 1.0, 2.0, 0.5, 1.0, 1.0, 1.0])
    quotas = ErrorGate(PAPER).allocate(allocation(mean_logit, logit_var, counts, 37)).flatten()
    assert int(quotas.sum()) == 37
    assert quotas[1] == 0 and quotas[0] > 0 and quotas[4] > 0  # only the clusters near the top logit get reads


def test_clusters_with_identical_logits_get_budget_last():
    counts = torch.tensor([10.0, 10.0, 10.0])
    quotas = ErrorGate(PAPER).allocate(allocation(torch.zeros(3), torch.tensor([0.0, 1.0, 0.0]), counts, 15)).flatten()
    assert quotas[1] == 10 and int(quotas.sum()) == 15  # the only cluster with spread fills first
    none = ErrorGate(PAPER).allocate(allocation(torch.zeros(3), torch.zeros(3), counts, 7)).flatten()
    assert int(none.sum()) == 7 and (none <= counts).all()


def test_error_estimate_matches_the_gaussian_formula():
    mean_logit, logit_var, counts = torch.tensor([0.3]), torch.tensor([1.7]), torch.tensor([12.0])
    log_error, log_mass = log_error_estimate(mean_logit, logit_var, counts)
    sigma = math.sqrt(1.7)
    phi = 0.5 * (1 + math.erf(sigma / math.sqrt(2)))
    expected = 12 * math.exp(0.3) * math.exp(1.7 / 2) * (2 * phi - 1)  # paper Eq. 6
    assert math.isclose(float(log_error.exp()), expected, rel_tol=1e-5)
    assert math.isclose(float(log_mass.exp()), 12 * math.exp(0.3 + 0.85), rel_tol=1e-5)


def test_shared_selection_sums_each_heads_relative_error():
    counts = torch.full((1, 1, 4), 10.0)
    # Head 0 wants cluster 0, head 1 wants cluster 3, equally strongly: the shared split is symmetric.
    mean_logit = torch.tensor([[5.0, 0, 0, 0], [0, 0, 0, 5.0]]).view(1, 1, 2, 1, 4)
    inputs = AllocationInput(
        mean_logit,
        torch.ones_like(mean_logit),
        counts,
        torch.zeros(1, 1, 1, 1, 40),
        torch.zeros(1, 1, 40, dtype=torch.long),
        torch.tensor(12).view(1, 1, 1, 1),
    )
    quotas = ErrorGate(PAPER).allocate(inputs)
    assert quotas.shape == (1, 1, 1, 1, 4)
    assert quotas.flatten().tolist()[0] == quotas.flatten().tolist()[3] and int(quotas.sum()) == 12


def fused_inputs(seed, B=2, H=2, g=4, T=2, C=20, shared=False):
    """Random AllocationInput with the hard cases: ragged and empty clusters, a row without clusters, clusters of
    identical logits (σ = 0) in one head and in every head, budgets of 0, ordinary and above Σ n_b, strided stats."""
    gen = torch.Generator().manual_seed(seed)
    Gs = 1 if shared else g
    mean = (torch.randn(B, H, T, g, C + 3, generator=gen) * 3).transpose(2, 3)[..., :C]  # not contiguous
    var = torch.rand(B, H, g, T, C, generator=gen) * 2
    var[0, 0, :, :, 3] = 0
    var[0, 1, g - 1, :, 5] = 0
    counts = torch.randint(0, 40, (B, H, C), generator=gen).float()
    counts[0, 0, 7] = 0
    counts[0, 1, :3] = 0
    counts[-1, -1] = 0
    budget = torch.tensor([0, 150, 100_000, 37] * B)[: B * H].view(B, H, 1, 1)
    scores = torch.zeros(B, H, Gs, T, 8)
    return AllocationInput(mean, var, counts, scores, torch.zeros(B, H, 8, dtype=torch.long), budget)


@pytest.mark.parametrize("g, shared", [(4, False), (4, True), (3, True), (1, False)])
def test_the_fused_triton_errorgate_matches_the_torch_one(g, shared):
    """The GPU path of ErrorGate (priority, sum over the group and water-filling in one Triton kernel), run by Triton's
    interpreter here, gives the torch ops' quotas exactly."""
    pytest.importorskip("triton")
    from oa_core.ops.water_filling import WaterFillAllocator
    from oa_plugins.allocators.errorgate import allocate_triton, fused_applies

    for seed in range(2):
        inputs = fused_inputs(seed, g=g, shared=shared)
        if not fused_applies(inputs, on_cpu=True):
            pytest.skip("the Triton path needs TRITON_INTERPRET=1 on the CPU")
        fast = allocate_triton(inputs)
        reference = WaterFillAllocator.allocate(ErrorGate(PAPER), inputs)  # the torch ops
        assert fast.shape == reference.shape == (2, 2, 1 if shared else g, 2, 20)
        assert torch.equal(fast, reference)
        target = torch.minimum(inputs.budget, inputs.counts.sum(-1).long()[..., None, None])
        assert torch.equal(fast.sum(-1), target.expand(fast.shape[:-1]))


def test_the_fused_triton_errorgate_handles_extreme_logits_like_the_torch_one():
    pytest.importorskip("triton")
    from oa_core.ops.water_filling import WaterFillAllocator
    from oa_plugins.allocators.errorgate import allocate_triton, fused_applies

    counts = torch.full((8,), 20.0)
    mean_logit = torch.tensor([1e4, -1e4, 9990.0, 0.0, 1e4, -5e3, 3.0, 9999.0])
    logit_var = torch.tensor([1.0, 4.0, 1.0, 2.0, 0.5, 1.0, 1.0, 1.0])
    for budget in (0, 37, 160, 500):
        inputs = allocation(mean_logit, logit_var, counts, budget)
        if not fused_applies(inputs, on_cpu=True):
            pytest.skip("the Triton path needs TRITON_INTERPRET=1 on the CPU")
        assert torch.equal(allocate_triton(inputs), WaterFillAllocator.allocate(ErrorGate(PAPER), inputs))


def test_errorgate_takes_the_fused_path_where_it_applies(monkeypatch):
    """The CPU runs the torch ops by default; with INTERPRET_ON_CPU (and the interpreter) ErrorGate.allocate runs the
    fused kernel, which passes the allocator conformance checks (per head and shared, empty clusters and rows)."""
    pytest.importorskip("triton")
    from oa_core.testing import check_allocator
    from oa_plugins.allocators import errorgate

    inputs = fused_inputs(0, shared=True)
    assert not errorgate.fused_applies(inputs)
    if not errorgate.fused_applies(inputs, on_cpu=True):
        pytest.skip("the Triton path needs TRITON_INTERPRET=1 on the CPU")
    fused, calls = errorgate.allocate_triton, []

    def counted(inputs):
        calls.append(inputs)
        return fused(inputs)

    monkeypatch.setattr(errorgate, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(errorgate, "allocate_triton", counted)
    check_allocator(ErrorGate, {"floor": 0.0})
    assert calls


def heads_that_differ(seed, shared):
    """AllocationInput where the heads of a KV group live at different logit scales (head 0's Ẑ is e^25 times head
    1's, so dividing by each head's Ẑ decides the shared split), with σ̂ spread over clusters: inputs on which a
    missing Ẑ, a missing erf factor or a missing σ̂²/2 each change the quotas."""
    gen = torch.Generator().manual_seed(seed)
    B, H, g, T, C = 2, 2, 3, 2, 24
    mean = torch.randn(B, H, g, T, C, generator=gen) * 2
    mean[:, :, 0] += 25.0
    mean[:, :, 2] -= 10.0
    var = torch.rand(B, H, g, T, C, generator=gen) * 3
    var[..., 5] = 0  # identical logits: no error
    counts = torch.randint(1, 60, (B, H, C), generator=gen).float()
    budget = torch.tensor([40, 150, 7, 600])[: B * H].view(B, H, 1, 1)
    Gs = 1 if shared else g
    return AllocationInput(
        mean, var, counts, torch.zeros(B, H, Gs, T, 8), torch.zeros(B, H, 8, dtype=torch.long), budget
    )


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per head"])
def test_quotas_are_eq7_water_filling_of_eq6_estimates(path, shared):
    """Against the float64 references written from the paper (oa_core.testing.references): ε̂_b of Eq. 6 over each head's
    Ẑ, summed over a shared group, water-filled by Eq. 7 and rounded by largest remainders."""
    from oa_core.ops.water_filling import WaterFillAllocator
    from oa_core.testing import references
    from oa_plugins.allocators.errorgate import allocate_triton, fused_applies

    for seed in range(3):
        inputs = heads_that_differ(seed, shared)
        if path == "triton":
            pytest.importorskip("triton")
            if not fused_applies(inputs, on_cpu=True):
                pytest.skip("the Triton path needs TRITON_INTERPRET=1 on the CPU")
            quotas = allocate_triton(inputs)
        else:
            quotas = WaterFillAllocator.allocate(ErrorGate(PAPER), inputs)
        priority = references.errorgate_priority(inputs.mean_logit, inputs.logit_var, inputs.counts, shared)
        capacity = inputs.counts[:, :, None, None, :]
        ideal = references.water_fill(priority, capacity, inputs.budget)
        assert not references.rounding_violations(quotas, ideal, capacity).any()


def _floor_case(seed=0, C=6, N=240, budget=30):
    gen = torch.Generator().manual_seed(seed)
    assignment = torch.randint(0, C, (1, 1, N), generator=gen)
    assignment[..., :10] = C  # outside the clusters
    counts = torch.zeros(1, 1, C).scatter_add_(-1, assignment.clamp_max(C - 1), (assignment < C).float())
    scores = torch.randn(1, 1, 1, 1, N, generator=gen).masked_fill(assignment[:, :, None, None] == C, -math.inf)
    mean = torch.randn(1, 1, 1, 1, C, generator=gen)
    var = torch.rand(1, 1, 1, 1, C, generator=gen)
    return AllocationInput(mean, var, counts, scores, assignment, torch.tensor(budget).view(1, 1, 1, 1), budget)


@pytest.mark.parametrize("floor", [0.25, 0.5, 1.0])
def test_a_floor_reads_the_best_scored_rows_first_and_keeps_the_quota_contract(floor):
    from oa_core.ops.selection import select

    for seed in range(5):
        inputs = _floor_case(seed)
        quotas = ErrorGate(ErrorGate.Config(floor=floor)).allocate(inputs)
        counts = inputs.counts[:, :, None, None, :]
        assert (quotas >= 0).all() and (quotas <= counts).all() and int(quotas.sum()) == 30
        chosen = set(select(inputs.scores, inputs.assignment, quotas, 30).flatten().tolist())
        best = inputs.scores.flatten().argsort(descending=True)[: math.floor(floor * 30)]
        assert set(best.tolist()) <= chosen  # every one of the floor's rows is read


def test_floor_zero_is_the_papers_errorgate_and_one_is_global_top_k():
    from oa_core.testing import references
    from oa_plugins.allocators.global_topk import GlobalTopK

    inputs = _floor_case(3)
    priority = references.errorgate_priority(inputs.mean_logit, inputs.logit_var, inputs.counts, False)
    capacity = inputs.counts[:, :, None, None, :]
    ideal = references.water_fill(priority, capacity, inputs.budget)  # Eq. 7 over Eq. 6, from the paper
    assert not references.rounding_violations(ErrorGate(PAPER).allocate(inputs), ideal, capacity).any()
    assert torch.equal(ErrorGate(ErrorGate.Config(floor=1.0)).allocate(inputs), GlobalTopK().allocate(inputs))
    assert not ErrorGate(PAPER).reads_scores and ErrorGate().reads_scores  # the default's floor: 0.5


def test_a_floor_outside_zero_to_one_is_refused_naming_the_field():
    import oa_core as oa

    with pytest.raises(oa.SpecError, match="floor"):
        oa.build({"allocator": {"name": "errorgate", "params": {"floor": 1.5}}})
