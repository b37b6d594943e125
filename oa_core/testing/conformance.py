"""Conformance checks for components: what every clusterer, selector, allocator and kernel must do.

A plugin author runs them against a component class (or a registered name) from their own tests::

    from oa_core.testing import check_component

    def test_my_selector_conforms():
        check_component("selector", MySelector)

Each check builds seeded random inputs with GQA (3 query heads per KV head), a batch of 2 with one left-padded row,
and float32/bfloat16 caches, calls the component directly, then runs it inside a pipeline. The rules are the ones the
pipeline enforces at run time (``oa_core.contracts``), plus what only seeded inputs can show: determinism, values
against the float64 references of the paper's equations (``oa_core.testing.references``), growth. A broken rule raises
``ContractViolation`` naming the component and the rule. The built-in components pass the same checks
(``tests/test_conformance.py``).
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
from torch import Tensor

from oa_core.components import (
    KINDS,
    AllocationInput,
    Allocator,
    Clusterer,
    Clusters,
    Component,
    Kernel,
    PooledClusters,
    Selection,
    Selector,
    group_queries,
)
from oa_core.contracts import ContractViolation, check_clusters, check_output, check_quotas, check_scores, expect
from oa_core.registry import default_registry
from oa_core.testing import references

# Pipelines of the built-in defaults that each check swaps one component into.
BASE_SPEC = {
    "clusterer": {"name": "qgc", "num_clusters": 8},
    "selector": "qgs",
    "allocator": "errorgate",
    "kernel": "torch",
    "sink": 4,
    "local": 16,
    "budget": {"density": 0.2},
}


def make_inputs(
    batch: int = 2,
    kv_heads: int = 2,
    group: int = 3,
    tokens: int = 300,
    dim: int = 32,
    queries: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A cache with clustered, unevenly scaled keys (so attention is peaked, as in real models), prefill queries and
    decode queries drawn near the keys → (keys, values, prefill queries, decode queries). Seeded; CPU."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(batch, kv_heads, 12, dim, generator=gen) * 2
    member = torch.randint(12, (batch, kv_heads, tokens), generator=gen)
    keys = centres.gather(2, member[..., None].expand(-1, -1, -1, dim)) + 0.7 * torch.randn(
        batch, kv_heads, tokens, dim, generator=gen
    )
    values = torch.randn(batch, kv_heads, tokens, dim, generator=gen)
    heads = kv_heads * group
    prefill = torch.randn(batch, heads, 64, dim, generator=gen) * 1.5
    picks = torch.randint(tokens, (queries,), generator=gen)
    decode = keys[:, (torch.arange(heads) // group)[:, None], picks[None, :]] * 1.2
    decode = decode + 0.3 * torch.randn(decode.shape, generator=gen)
    keys, values, prefill, decode = (t.to(dtype) for t in (keys, values, prefill, decode))
    return keys, values, prefill, decode


def _inputs(dtype: torch.dtype = torch.float32):
    """The kit's inputs: GQA (3 query heads per KV head), a batch of 2, 160 tokens."""
    return make_inputs(tokens=160, dtype=dtype)


_ComponentRef = Component | type[Component] | str  # an instance, a class, or a registered name


@overload
def _instance(kind: Literal["clusterer"], component: _ComponentRef, params: dict | None = None) -> Clusterer: ...
@overload
def _instance(kind: Literal["selector"], component: _ComponentRef, params: dict | None = None) -> Selector: ...
@overload
def _instance(kind: Literal["allocator"], component: _ComponentRef, params: dict | None = None) -> Allocator: ...
@overload
def _instance(kind: Literal["kernel"], component: _ComponentRef, params: dict | None = None) -> Kernel: ...
@overload
def _instance(kind: str, component: _ComponentRef, params: dict | None = None) -> Component: ...


def _instance(kind: str, component: _ComponentRef, params: dict | None = None) -> Component:
    if isinstance(component, str):
        info = default_registry().get(kind, component)
        if info is None:
            raise ContractViolation(
                f"no {kind} named {component!r} is registered; known: {', '.join(default_registry().names(kind))}"
            )
        component = info.cls
    if isinstance(component, type):
        if not issubclass(component, KINDS[kind]):
            raise ContractViolation(f"{component.__name__} is not a {KINDS[kind].__name__} subclass")
        if not (isinstance(getattr(component, "name", None), str) and component.name):
            raise ContractViolation(f"{component.__name__} needs a non-empty class attribute `name`")
        component = component(component.Config.model_validate(params or {}))
    if not isinstance(component, KINDS[kind]):
        raise ContractViolation(f"{type(component).__name__} is not a {KINDS[kind].__name__}")
    return component


def check_clusterer(component, params: dict | None = None) -> None:
    """fit: an assignment ``[B, Hkv, N]`` with C exactly outside the mask and < C inside, the same for the same seed;
    assign: ids in [0, C) for new keys."""
    clusterer = _instance("clusterer", component, params)
    keys, _, prefill, _ = _inputs()
    B, H, N, _ = keys.shape
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, :30] = False  # padding
    mask[:, :4] = False  # sink
    mask[:, -16:] = False  # local window
    fit = [clusterer.fit(keys, prefill, mask, torch.Generator().manual_seed(7)) for _ in range(2)]
    clusters = fit[0]
    check_clusters(clusterer, clusters, mask, H)
    C = clusters.num_clusters
    expect(
        torch.equal(clusters.assignment, fit[1].assignment),
        clusterer,
        "fit must be deterministic for the same generator seed",
    )
    new = clusterer.assign(clusters, keys[:, :, :5])
    expect(
        new.shape == (B, H, 5) and bool(((new >= 0) & (new < C)).all()),
        clusterer,
        "assign must return ids in [0, C) of shape [B, Hkv, t]",
    )


def check_selector(component, params: dict | None = None) -> None:
    """score: float32 ``[B, Hkv, Gs, T, N]``, per query head and shared by the group, finite on the clusters,
    deterministic; refine keeps the shape and the -inf outside the clusters; extend then score equals build on all
    keys (the appended keys leave the keys' mean as it was, and lie outside every cluster, as a decode step's keys
    do: in the local window)."""
    selector = _instance("selector", component, params)
    keys, _, prefill, decode = _inputs()
    B, H, N, _ = keys.shape
    Hq, T = decode.shape[1], decode.shape[2]
    C = 5
    assignment = torch.arange(N).remainder(C).expand(B, H, N).clone()
    assignment[..., :4] = C
    clusters = Clusters(assignment, C)
    index = selector.build(keys, prefill, clusters, torch.Generator().manual_seed(3))
    for shared in (False, True):
        query = group_queries(decode, H, shared)
        scores = selector.score(query, index, keys, 0.2)
        check_scores(selector, scores, (B, H, query.shape[2], T, N))
        expect(bool(torch.isfinite(scores[..., 4:]).all()), selector, "scores of clustered positions must be finite")
        again = selector.build(keys, prefill, clusters, torch.Generator().manual_seed(3))
        expect(
            torch.equal(scores, selector.score(query, again, keys, 0.2)),
            selector,
            "build + score must be deterministic for the same seed",
        )
        masked = scores.masked_fill((assignment == C)[:, :, None, None], float("-inf"))
        refined = selector.refine(masked, query, index, keys, 0.2, torch.full((B, H, 1, 1), 20), 20)
        check_scores(selector, refined, tuple(masked.shape))
        expect(
            bool((refined[..., :4] == float("-inf")).all()),
            selector,
            "refine must keep -inf where the scores have it (positions outside every cluster)",
        )
    # Growth: build on the first N − 10 keys, extend by 10 whose mean is theirs (pairs m ± d) and that no cluster
    # holds (decode keys arrive in the local window), so that an index built on statistics of the keys (LSH centres
    # on their mean; QGS's key spread is the clustered keys') sees the same statistics either way.
    first = keys[:, :, : N - 10]
    mean = first[:, :, 4:].mean(2, keepdim=True)
    spread = first[:, :, 4:9] - mean
    grown_keys = torch.cat([first, mean + spread, mean - spread], dim=2)
    query = group_queries(decode, H, shared=False)
    grown = selector.extend(
        selector.build(first, prefill, Clusters(assignment[..., : N - 10], C), torch.Generator().manual_seed(3)),
        grown_keys[:, :, N - 10 :],
    )
    grown_scores = selector.score(query, grown, grown_keys, 0.2)
    check_scores(selector, grown_scores, (B, H, Hq // H, T, N))
    window = assignment.clone()
    window[..., N - 10 :] = C
    whole = selector.build(grown_keys, prefill, Clusters(window, C), torch.Generator().manual_seed(3))
    expect(
        torch.allclose(grown_scores, selector.score(query, whole, grown_keys, 0.2), rtol=1e-4, atol=1e-4),
        selector,
        "build on N − 10 keys then extend by 10 must score like build on all N keys",
    )


def check_allocator(component, params: dict | None = None) -> None:
    """allocate: integer quotas ``[B, Hkv, Gs, T, C]`` with 0 ≤ q_b ≤ n_b and Σ q_b = min(E_sel, Σ n_b), per head and
    shared, deterministic."""
    allocator = _instance("allocator", component, params)
    gen = torch.Generator().manual_seed(5)
    B, H, g, T, C, N = 2, 2, 3, 2, 6, 90
    assignment = torch.randint(C, (B, H, N), generator=gen)
    assignment[..., :3] = C
    assignment[0, 0] = assignment[0, 0].masked_fill(assignment[0, 0] == 2, C)  # an empty cluster
    assignment[1, 1] = C  # a row without clusters (read densely inside a sparse batch)
    counts = torch.nn.functional.one_hot(assignment, C + 1)[..., :C].sum(2).float()
    budget = torch.tensor([[7, 200], [0, 31]]).view(B, H, 1, 1)
    for shared in (False, True):
        Gs = 1 if shared else g
        scores = torch.randn(B, H, Gs, T, N, generator=gen).masked_fill((assignment == C)[:, :, None, None], -math.inf)
        inputs = AllocationInput(
            torch.randn(B, H, g, T, C, generator=gen),
            torch.rand(B, H, g, T, C, generator=gen),
            counts,
            scores,
            assignment,
            budget,
        )
        quotas = allocator.allocate(inputs)
        check_quotas(allocator, quotas, inputs, exact=True)
        expect(torch.equal(quotas, allocator.allocate(inputs)), allocator, "allocate must be deterministic")


def check_kernel(component, params: dict | None = None) -> None:
    """attend: the query's shape and dtype; without a selection, dense softmax attention; with one, the estimator of
    Eq. 1 (``oa_core.testing.references.proxy_attention``, float64): exact rows plus one count-aware proxy per
    cluster's unread tail (each proxy order the kernel declares in ``proxies``), or the tail discarded, with weighted
    (sampled) rows, per query head and shared over the group."""
    kernel = _instance("kernel", component, params)
    keys, values, _, decode = _inputs()
    B, H, N, D = keys.shape
    Hq, T = decode.shape[1], decode.shape[2]
    out, _ = kernel.attend(decode, keys, values, None, None, 0.2)
    check_output(kernel, out, decode)
    expected = references.proxy_attention(decode, keys, values, None, None, 0, 0.2)
    expect(_relative_error(out, expected) < 1e-5, kernel, "without a selection attend is dense softmax attention")
    gen = torch.Generator().manual_seed(9)
    C = 6
    assignment = torch.randint(C, (B, H, N), generator=gen)
    assignment[..., :4] = C
    assignment[0, 0] = assignment[0, 0].masked_fill(assignment[0, 0] == 0, 1)
    assignment[0, 0, 4:20] = 0  # a cluster one row of each selection below reads in full: no proxy for it there
    one_hot = torch.nn.functional.one_hot(assignment, C + 1)[..., :C].float()
    sums = (
        one_hot.sum(2),
        one_hot.transpose(-1, -2) @ keys,
        one_hot.transpose(-1, -2) @ values,
        assignment,
        one_hot.transpose(-1, -2) @ (keys * keys),
    )
    pooled = {order: PooledClusters(*sums, second_order=order == "second-order") for order in type(kernel).proxies}
    for Gs in (1, Hq // H):
        index = torch.rand(B, H, Gs, T, N, generator=gen).argsort(-1)[..., :24]
        order = torch.rand(N, generator=gen)
        order[4:20] = torch.arange(16) - 100.0  # first: the whole of cluster 0, then other rows, none twice
        index[0, 0, 0, 0] = order.argsort()[:24]
        index[..., -3:] = -1  # padding
        log_weight = torch.rand(index.shape, generator=gen) * (torch.arange(24) >= 18)  # a few weighted rows
        selection = Selection(index, log_weight)
        for proxies in (*pooled.values(), None):
            out, used = kernel.attend(decode, keys, values, selection, proxies, 0.2)
            second = proxies is not None and proxies.second_order
            expected = references.proxy_attention(
                decode, keys, values, index, assignment if proxies else None, C, 0.2, log_weight, second_order=second
            )
            error = _relative_error(out, expected)
            kind = "none" if proxies is None else "second-order" if second else "mean"
            expect(
                error < 1e-5,
                kernel,
                "differs from Eq. 1 (oa_core.testing.references.proxy_attention): "
                f"relative error {error:.2e}, Gs={Gs}, proxies: {kind}",
            )


def _relative_error(got: Tensor, expected: Tensor) -> float:
    return float((got.double() - expected).norm() / expected.norm())


CHECKS = {
    "clusterer": check_clusterer,
    "selector": check_selector,
    "allocator": check_allocator,
    "kernel": check_kernel,
}


def check_pipeline(kind: str, component, params: dict | None = None) -> None:
    """The component inside a pipeline (the built-in defaults for the other kinds): builds from a spec, runs with
    GQA, a left-padded batch of 2, float32 and bfloat16 caches and decode-time growth, stays within its budget, and is
    deterministic."""
    name = component if isinstance(component, str) else component.name
    spec = {**BASE_SPEC, kind: {"name": name, **(params or {})}}
    from oa_core.pipeline import build

    for dtype in (torch.float32, torch.bfloat16):
        keys, values, prefill, decode = _inputs(dtype=dtype)
        mask = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool)
        mask[1, :30] = False
        runs = []
        for _ in range(2):
            pipe = build(spec)
            state = pipe.prepare(keys, values, prefill, mask=mask)
            state.append(keys[:, :, :2], values[:, :, :2])
            out, stats = pipe.attend(decode, state, return_stats=True)
            runs.append(out)
        tested = getattr(pipe, kind)
        expect(bool(torch.isfinite(out).all()), tested, f"the pipeline's output must be finite ({dtype})")
        budget = pipe.spec.budget.rows(state.valid.sum(-1))
        expect(bool((stats.reads <= budget.view(-1, 1, 1, 1)).all()), tested, "a pipeline must stay within its budget")
        expect(torch.equal(runs[0], runs[1]), tested, "a pipeline must be deterministic for a fixed seed")


def check_component(
    kind: str, component: Component | type[Component] | str, params: dict | None = None, pipeline: bool = True
) -> None:
    """Every check of ``kind`` for ``component`` (a class, an instance, or a registered name), then — with
    ``pipeline`` and a registered name — the same component inside a pipeline (``check_pipeline``)."""
    if kind not in CHECKS:
        raise ValueError(f"kind: expected one of {', '.join(CHECKS)}, got {kind!r}")
    CHECKS[kind](component, params)
    if pipeline:
        registered = component if isinstance(component, str) else getattr(component, "name", None)
        if registered is None or default_registry().get(kind, registered) is None:
            raise ContractViolation(
                f"{kind} {registered!r} is not registered through the 'openattention' entry "
                "points, so a spec cannot name it (install the package, or pass pipeline=False)"
            )
        check_pipeline(kind, registered, params)
