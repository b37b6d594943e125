"""The rules inputs and components must keep, written once: the pipeline checks them at run time and the conformance
kit (``oa_core.testing``) on seeded inputs. A broken rule raises ``ContractViolation`` naming the component, its kind
and the package that registered it; bad user input raises ``ValueError``/``TypeError`` naming the argument.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oa_core.components import KINDS, AllocationInput, Clusters, Component
from oa_core.registry import default_registry


class ContractViolation(RuntimeError):
    """A component returned something its kind's contract forbids (wrong shape, over budget, ...)."""


def violation(component: Component, rule: str) -> ContractViolation:
    """A ContractViolation naming the component, its class, its kind and the package that registered it."""
    kind = next((k for k, base in KINDS.items() if isinstance(component, base)), "component")
    name = getattr(component, "name", "?")
    info = default_registry().get(kind, name) if kind in KINDS else None
    package = info.package if info is not None and info.cls is type(component) else type(component).__module__
    return ContractViolation(
        f"{kind} {name!r} ({type(component).__name__}, package {package!r}) broke its contract: {rule}"
    )


def expect(condition: bool, component: Component, rule: str) -> None:
    if not condition:
        raise violation(component, rule)


# -- the user's inputs ---------------------------------------------------------------------------------------------


def check_cache(
    keys: Tensor, values: Tensor, like: Tensor | None = None, what: str = "", finite: bool = True, empty: bool = False
) -> None:
    """keys/values ``[B, Hkv, N, D]``, floating, of one dtype and device (and, with ``like``, the same B, Hkv, D,
    dtype and device as it); ``finite``: no NaN/Inf (one wait on the device); ``empty``: N may be 0 (rows appended),
    else no dimension may be."""
    for name, t in ((f"{what}keys", keys), (f"{what}values", values)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected shape [B, Hkv, N, D], got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    if keys.shape != values.shape:
        raise ValueError(f"{what}keys and values differ in shape: {tuple(keys.shape)} vs {tuple(values.shape)}")
    if not empty and 0 in keys.shape:
        names = ", ".join(f"{n} = 0" for n, size in zip(("B", "Hkv", "N", "D"), keys.shape) if size == 0)
        raise ValueError(f"{what}keys: an empty cache {tuple(keys.shape)} ({names}); prepare needs at least one row")
    if keys.dtype != values.dtype or keys.device != values.device:
        raise ValueError(
            f"{what}keys ({keys.dtype}, {keys.device}) and values ({values.dtype}, {values.device}) "
            "must share dtype and device"
        )
    if like is not None and (
        keys.shape[:2] + keys.shape[3:] != like.shape[:2] + like.shape[3:]
        or keys.dtype != like.dtype
        or keys.device != like.device
    ):
        raise ValueError(
            f"{what}keys {tuple(keys.shape)} {keys.dtype} {keys.device} do not match the cache "
            f"{tuple(like.shape)} {like.dtype} {like.device} (only N may differ)"
        )
    if finite and not bool(all_finite(keys, values)):
        name = f"{what}keys" if not bool(all_finite(keys)) else f"{what}values"
        raise ValueError(f"{name}: the cache contains NaN or Inf")


def all_finite(*tensors: Tensor) -> Tensor:
    """Whether every element of ``tensors`` (on one device) is finite, as a 0-d bool tensor (no wait on the device):
    from each one's least and greatest elements — a NaN makes both NaN, an infinity is one of them. One reduction
    per tensor, read in place, where ``isfinite(t).all()`` makes four passes over it with its bool temporaries (0.43
    against 1.98 ms for a 16 × 8 × 16K × 128 bfloat16 cache's keys and values on an H200)."""
    ends = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel()]
    if not ends:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device)
    return torch.isfinite(torch.cat(ends)).all()


def check_query(query: Tensor, keys: Tensor, name: str, finite: bool = True, heads: int | None = None) -> None:
    """query ``[B, Hq, T, D]``, T ≥ 1, matching the cache ``keys`` (batch, head dim, dtype, device; Hq a multiple of
    Hkv, and ``heads`` where given: the prefill queries' count)."""
    if not isinstance(query, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(query).__name__}")
    if query.dim() != 4:
        raise ValueError(f"{name}: expected shape [B, Hq, T, D], got {tuple(query.shape)}")
    if query.shape[1] == 0 or query.shape[2] == 0:
        hint = "; pass queries=None to prepare without prefill queries" if name == "queries" else ""
        raise ValueError(
            f"{name}: no queries in {tuple(query.shape)} ([B, Hq, T, D] with "
            f"{'Hq' if query.shape[1] == 0 else 'T'} = 0){hint}"
        )
    B, Hkv, _, D = keys.shape
    if query.shape[0] != B or query.shape[3] != D:
        raise ValueError(f"{name}: batch and head dim {tuple(query.shape)} do not match the keys {tuple(keys.shape)}")
    if query.shape[1] % Hkv:
        raise ValueError(f"{name}: {query.shape[1]} query heads is not a multiple of {Hkv} KV heads")
    if heads is not None and query.shape[1] != heads:
        raise ValueError(
            f"{name}: {query.shape[1]} query heads, but the prefill queries prepare() was given had {heads}"
        )
    if query.dtype != keys.dtype or query.device != keys.device:
        raise ValueError(
            f"{name}: dtype/device {query.dtype}/{query.device} differ from the cache's {keys.dtype}/{keys.device}"
        )
    if finite and not bool(all_finite(query)):
        raise ValueError(f"{name}: contains NaN or Inf")


def check_mask(mask: Tensor | None, keys: Tensor) -> Tensor:
    """``[B, N]`` valid positions (False: padding) → the bool mask; all True when None."""
    B, _, N, _ = keys.shape
    if mask is None:
        return torch.ones(B, N, dtype=torch.bool, device=keys.device)
    if not isinstance(mask, Tensor) or mask.shape != (B, N):
        raise ValueError(
            f"mask: expected a [B, N] = [{B}, {N}] tensor, got "
            f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}"
        )
    if mask.device != keys.device:
        raise ValueError(f"mask: device {mask.device} differs from the cache's {keys.device}")
    if mask.dtype != torch.bool:
        odd = mask[(mask != 0) & (mask != 1)]
        if odd.numel():
            raise ValueError(
                f"mask: expected bool, or 0 (padding) and 1 (valid) values; got {mask.dtype} values "
                f"such as {', '.join(str(v) for v in odd[:3].tolist())}"
            )
    mask = mask.bool()
    if not bool(mask.any(-1).all()):
        raise ValueError("mask: every batch row needs at least one valid position")
    return mask


def check_scale(scale: float | None, head_dim: int) -> float:
    """The logit scale s: 1/√D when None, else a positive finite number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    return float(scale)


# -- what components return ----------------------------------------------------------------------------------------


def check_clusters(clusterer: Component, clusters: Clusters, clusterable: Tensor, kv_heads: int) -> None:
    """fit's result: a Clusters whose assignment ``[B, Hkv, N]`` (long) holds ids in [0, C) on the clusterable
    region ``[B, N]`` and C elsewhere (a wait on the device: prepare runs once per request)."""
    expect(
        isinstance(clusters, Clusters), clusterer, f"fit must return oa_core.Clusters, got {type(clusters).__name__}"
    )
    a, C = clusters.assignment, clusters.num_clusters
    expect(isinstance(C, int) and C >= 1, clusterer, f"num_clusters must be a positive int, got {C!r}")
    shape = (clusterable.shape[0], kv_heads, clusterable.shape[1])
    expect(
        isinstance(a, Tensor) and tuple(a.shape) == shape and a.dtype == torch.long,
        clusterer,
        f"fit must return a long assignment [B, Hkv, N] = {list(shape)}, got "
        f"{getattr(a, 'dtype', type(a).__name__)} {list(getattr(a, 'shape', ()))}",
    )
    inside = clusterable[:, None, :].expand(shape)
    expect(
        bool((a[~inside] == C).all()) and bool(((a[inside] >= 0) & (a[inside] < C)).all()),
        clusterer,
        f"ids must be in [0, {C}) inside the clusterable region and {C} outside",
    )


def check_scores(selector: Component, scores: Tensor, shape: tuple[int, ...]) -> None:
    """score's result: float32 of ``shape`` ``[B, Hkv, Gs, T, N]``."""
    expect(
        isinstance(scores, Tensor) and tuple(scores.shape) == shape and scores.dtype == torch.float32,
        selector,
        f"score must return float32 [B, Hkv, Gs, T, N] = {list(shape)}, got "
        f"{getattr(scores, 'dtype', type(scores).__name__)} {list(getattr(scores, 'shape', ()))}",
    )


def check_quotas(
    allocator: Component, quotas: Tensor, inputs: AllocationInput, values: bool = True, exact: bool = False
) -> None:
    """allocate's result: integer ``[B, Hkv, Gs, T, C]``; with ``values`` (one wait on the device) also
    0 ≤ q_b ≤ n_b and Σ_b q_b ≤ E_sel — or, ``exact``, Σ_b q_b = min(E_sel, Σ_b n_b)."""
    expected = (*inputs.scores.shape[:-1], inputs.counts.shape[-1])
    expect(
        isinstance(quotas, Tensor) and tuple(quotas.shape) == expected and not quotas.is_floating_point(),
        allocator,
        f"allocate must return integer quotas [B, Hkv, Gs, T, C] = {list(expected)}, got "
        f"{getattr(quotas, 'dtype', type(quotas).__name__)} {list(getattr(quotas, 'shape', ()))}",
    )
    if not values:
        return
    counts = inputs.counts[:, :, None, None]
    budget = inputs.budget.reshape(*inputs.budget.shape[:2], 1, 1)
    in_range = ((quotas >= 0) & (quotas <= counts)).all()
    total = quotas.sum(-1)
    if exact:
        target = torch.minimum(budget, counts.sum(-1).long())
        adds_up, rule = (total == target).all(), "quotas must add up to min(E_sel, Σ n_b)"
    else:
        adds_up, rule = (total <= budget).all(), "quotas must add up to at most the budget E_sel"
    if not bool(in_range & adds_up):  # one wait on the device
        expect(bool(in_range), allocator, "quotas must lie in [0, n_b]")
        expect(False, allocator, rule)


def check_output(kernel: Component, out: Tensor, query: Tensor) -> None:
    """attend's result: the query's shape and dtype."""
    expect(
        isinstance(out, Tensor) and out.shape == query.shape and out.dtype == query.dtype,
        kernel,
        f"attend must return the query's shape {list(query.shape)} and dtype {query.dtype}, got "
        f"{getattr(out, 'dtype', type(out).__name__)} {list(getattr(out, 'shape', ()))}",
    )
