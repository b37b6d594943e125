"""The conformance kit (oa_core.testing) passes every built-in component and catches broken ones."""

import pytest
import torch

import oa_core as oa
from oa_core.components import Allocator, Selector
from oa_core.contracts import ContractViolation
from oa_core.testing import check_allocator, check_component, check_selector

BUILT_INS = [(kind, name) for kind, names in oa.available().items() for name in names]


@pytest.mark.parametrize("kind, name", BUILT_INS, ids=[f"{k}-{n}" for k, n in BUILT_INS])
def test_every_built_in_passes(kind, name):
    params = {"K": 4, "L": 8} if name == "lsh" else None
    check_component(kind, name, params)


@pytest.mark.parametrize(
    "kind, name, params", [("selector", "qgs", {"rerank": 2}), ("allocator", "errorgate", {"floor": 0.5})]
)
def test_the_two_stage_parameters_conform_too(kind, name, params):
    check_component(kind, name, params)


class LeakyRefineSelector(Selector):
    """Scores right, but a refine that fills the positions outside every cluster."""

    name = "leaky-refine-test"

    @property
    def refines(self):
        return True

    def score(self, query, index, keys, scale):
        B, H, Gs, G, T, D = query.shape
        return torch.zeros(B, H, Gs, T, keys.shape[2])

    def refine(self, scores, query, index, keys, scale, budget, width):
        return scores.nan_to_num(neginf=0.0)


def test_a_refine_that_fills_the_unclustered_positions_is_caught():
    with pytest.raises(ContractViolation, match="refine must keep -inf"):
        check_selector(LeakyRefineSelector)


class GreedyAllocator(Allocator):
    """Spends the whole budget on the first cluster, whatever its size."""

    name = "greedy-test"

    def allocate(self, inputs):
        quotas = torch.zeros(*inputs.scores.shape[:-1], inputs.counts.shape[-1], dtype=torch.long)
        quotas[..., 0] = inputs.budget.view(*inputs.budget.shape[:2], 1, 1).expand(quotas.shape[:-1])
        return quotas


class FlatSelector(Selector):
    """Scores of the wrong shape: one row per KV head, whatever the selection heads and queries."""

    name = "flat-test"

    def score(self, query, index, keys, scale):
        return torch.zeros(keys.shape[0], keys.shape[1], keys.shape[2])


def test_a_broken_allocator_is_caught_by_rule():
    with pytest.raises(
        ContractViolation,
        match=r"allocator 'greedy-test' \(GreedyAllocator, package "
        r"'.*test_conformance'\) broke its contract: quotas must lie in "
        r"\[0, n_b\]",
    ):
        check_allocator(GreedyAllocator)


def test_a_broken_selector_is_caught_by_rule():
    with pytest.raises(
        ContractViolation,
        match=r"selector 'flat-test' \(FlatSelector.*score must return float32 "
        r"\[B, Hkv, Gs, T, N\]",
    ):
        check_selector(FlatSelector)


def test_a_kernel_with_a_wrong_proxy_is_caught():
    """The kit holds kernels to Eq. 1, not to the torch kernel: one whose proxies keep the rows already read fails."""
    from oa_core.testing import check_kernel
    from oa_plugins.kernels.reference import TorchKernel

    class UnsubtractedProxy(TorchKernel):
        name = "unsubtracted-test"

        @staticmethod
        def _taken(cluster, heads, read_logits, C):  # the tails' counts right, their sums still holding the rows read
            count, read_sum, _ = TorchKernel._taken(cluster, heads, read_logits, C)
            return count, torch.zeros_like(read_sum), torch.full_like(heads, C)

    with pytest.raises(ContractViolation, match=r"kernel 'unsubtracted-test' \(UnsubtractedProxy.*differs from Eq. 1"):
        check_kernel(UnsubtractedProxy)


def test_a_selector_whose_growth_scores_differently_is_caught():
    from oa_plugins.selectors.qgs import QGSIndex, QuerySubspaceSelector, quantize

    class CoarseGrowth(QuerySubspaceSelector):
        """Indexes appended keys at half their scale."""

        name = "coarse-growth-test"

        def extend(self, index, keys):
            codes, scales = quantize(keys.float() @ index.basis)
            return QGSIndex(index.basis, torch.cat([index.codes, codes], 2), torch.cat([index.scales, scales / 2], 2))

    with pytest.raises(ContractViolation, match=r"'coarse-growth-test' .*build on N − 10 keys then extend"):
        check_selector(CoarseGrowth)


def test_an_unregistered_component_cannot_run_in_a_pipeline():
    from oa_plugins.allocators.uniform import UniformAllocator

    class Copy(UniformAllocator):
        name = "uniform-copy"

    check_component("allocator", Copy, pipeline=False)  # conforms on its own
    with pytest.raises(ContractViolation, match="'uniform-copy' is not registered"):
        check_component("allocator", Copy)


def _pipeline_with(**components):
    """A default pipeline with some components swapped for unregistered instances (no entry point needed)."""
    from oa_core.pipeline import Pipeline

    base = oa.build(
        {
            "clusterer": {"name": "qgc", "num_clusters": 8},
            "kernel": "torch",
            "sink": 4,
            "local": 16,
            "budget": {"density": 0.2},
        }
    )
    parts = {
        kind: components.get(kind, getattr(base, kind)) for kind in ("clusterer", "selector", "allocator", "kernel")
    }
    return Pipeline(base.spec, **parts)


def test_a_component_breaking_its_contract_at_run_time_is_named():
    from conftest import make_inputs
    from oa_core.components import Clusterer, Clusters, Kernel

    keys, values, prefill, decode = make_inputs(tokens=200, seed=3)

    pipe = _pipeline_with(allocator=GreedyAllocator())
    state = pipe.prepare(keys, values, prefill)
    with pytest.raises(
        ContractViolation,
        match=r"allocator 'greedy-test' \(GreedyAllocator, package "
        r"'.*test_conformance'\) broke its contract: quotas must lie in "
        r"\[0, n_b\]",
    ):
        pipe.attend(decode, state)

    class HalfKernel(Kernel):
        name = "half-test"

        def attend(self, query, keys, values, selection, proxies, scale):
            return query.double(), None

    pipe = _pipeline_with(kernel=HalfKernel())
    with pytest.raises(ContractViolation, match=r"kernel 'half-test'.*the query's shape .* and dtype torch.float32"):
        pipe.attend(decode, pipe.prepare(keys, values, prefill), validate=False)  # shape/dtype: checked always

    pipe = _pipeline_with(selector=FlatSelector())
    with pytest.raises(ContractViolation, match=r"selector 'flat-test'.*score must return float32"):
        pipe.attend(decode, pipe.prepare(keys, values, prefill), validate=False)  # shapes: checked always

    class OneCluster(Clusterer):
        name = "one-test"

        def fit(self, keys, queries, mask, generator):
            return Clusters(torch.zeros(keys.shape[:3], dtype=torch.long), 1)  # sink and local inside too

    pipe = _pipeline_with(clusterer=OneCluster())
    with pytest.raises(ContractViolation, match=r"clusterer 'one-test'.*ids must be in \[0, 1\) inside"):
        pipe.prepare(keys, values, prefill)
