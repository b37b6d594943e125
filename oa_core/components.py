"""The four component kinds and the plain-tensor records that pass between them.

Shapes follow transformers: ``[B, H, N, D]`` (batch, heads, tokens, head dim). ``Hkv`` is the number of KV heads,
``Hq = g * Hkv`` the number of query heads, ``T`` the number of decode queries and ``C`` the number of clusters.
Selection runs per *selection head*: ``Gs = g`` heads per KV head (``gqa: per_head``) or ``Gs = 1`` shared by the
group (``gqa: shared``), so every per-query tensor below is ``[B, Hkv, Gs, T, ...]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor


class ContractViolation(RuntimeError):
    """A component returned something its kind's contract forbids (wrong shape, over budget, ...)."""


def violation(component: Component, rule: str) -> ContractViolation:
    """A ContractViolation naming the component, its kind and the package that registered it."""
    from oa_core.registry import default_registry

    kind = next((k for k, base in KINDS.items() if isinstance(component, base)), "component")
    info = default_registry().get(kind, getattr(component, "name", ""))
    package = info.package if info is not None and info.cls is type(component) else type(component).__module__
    return ContractViolation(f"{kind} {component.name!r} (package {package!r}) broke its contract: {rule}")


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Component:
    """Base of every component: a registered ``name`` and a pydantic ``Config`` holding its parameters."""

    name: ClassVar[str]
    Config: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, config: BaseModel | None = None) -> None:
        self.config = config if config is not None else self.Config()

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config.model_dump().items())
        return f"{type(self).__name__}({params})"


@dataclass
class Clusters:
    """A clusterer's output for the clusterable region R of one layer.

    ``assignment``: ``[B, Hkv, N]`` cluster ids in ``[0, num_clusters)`` on R, ``num_clusters`` elsewhere.
    ``basis``: ``[B, Hkv, D, r]`` query-geometry basis U_r when the clusterer computed one (QGS reuses it).
    ``space``: whatever the clusterer's ``assign`` needs to place new tokens (projection, centroids).
    """

    assignment: Tensor
    num_clusters: int
    basis: Tensor | None = None
    space: Any = None


class Clusterer(Component):
    """Partitions the clusterable keys of each (batch row, KV head) into clusters, once per request."""

    def fit(self, keys: Tensor, queries: Tensor | None, mask: Tensor, generator: torch.Generator) -> Clusters:
        """keys ``[B, Hkv, N, D]``, prefill queries ``[B, Hq, M, D]`` or None, ``mask`` ``[B, N]``: the clusterable
        region R (rows may differ: padding, sink and local are outside it) → Clusters. ``generator``: a CPU generator
        seeded from the spec (draw on the CPU, move to the device: a seed means the same on every device)."""
        raise NotImplementedError

    def assign(self, clusters: Clusters, keys: Tensor) -> Tensor:
        """New keys ``[B, Hkv, t, D]`` leaving the local window → their cluster ids ``[B, Hkv, t]``."""
        raise NotImplementedError


@dataclass
class AllocationInput:
    """What an allocator sees for one attend call.

    ``mean_logit``, ``logit_var``: ``[B, Hkv, g, T, C]`` per query head: z̄_b = s·q·k̄_b, σ̂_b² = s²Σ_d q_d² Var_b(k_d).
    ``counts``: ``[B, Hkv, C]`` cluster sizes n_b.
    ``scores``: ``[B, Hkv, Gs, T, N]`` selector scores, -inf outside the clusterable region.
    ``assignment``: ``[B, Hkv, N]`` cluster id per position, ``C`` outside the clusterable region.
    ``budget``: E_sel, exact rows to spread over the clusters, ``[B, Hkv, 1, 1]`` (rows of a batch may differ).
    ``width``: an upper bound of ``budget`` known on the host (None: read it from ``budget``, a device sync).
    """

    mean_logit: Tensor
    logit_var: Tensor
    counts: Tensor
    scores: Tensor
    assignment: Tensor
    budget: Tensor
    width: int | None = None

    @property
    def shared(self) -> bool:
        return self.scores.shape[2] != self.mean_logit.shape[2]

    def combine_heads(self, log_priority: Tensor) -> Tensor:
        """``[B, Hkv, g, T, C]`` per-head log priorities → ``[B, Hkv, Gs, T, C]``: summed over the group when shared."""
        return torch.logsumexp(log_priority, dim=2, keepdim=True) if self.shared else log_priority


class Allocator(Component):
    """Splits the selectable budget E_sel over clusters (DESIGN.md §1 step 5)."""

    def allocate(self, inputs: AllocationInput) -> Tensor:
        """→ quotas q_b, integer ``[B, Hkv, Gs, T, C]`` with q_b ≤ n_b and Σ_b q_b = min(E_sel, Σ_b n_b)."""
        raise NotImplementedError


class Selector(Component):
    """Scores keys cheaply and reads, inside each cluster, its q_b best (DESIGN.md §1 steps 3 and 6)."""

    def build(self, keys: Tensor, queries: Tensor | None, clusters: Clusters, generator: torch.Generator) -> Any:
        """Once per request: keys ``[B, Hkv, N, D]`` → an index (plain tensors). ``generator``: a CPU generator
        seeded from the spec, for selectors that draw (LSH hyperplanes)."""
        return None

    def extend(self, index: Any, keys: Tensor) -> Any:
        """Decode-time growth: index the new keys ``[B, Hkv, t, D]`` appended after the old ones."""
        return index

    def score(self, query: Tensor, index: Any, keys: Tensor, scale: float) -> Tensor:
        """query ``[B, Hq, T, D]`` → approximate logits ``[B, Hq, T, N]`` (float32)."""
        raise NotImplementedError

    def group_scores(self, query: Tensor, index: Any, keys: Tensor, scale: float, shared: bool,
                     outside: Tensor | None = None) -> Tensor:
        """``[B, Hkv, Gs, T, N]``: ``score`` per query head (Gs = g), or its maximum over each KV head's group
        (Gs = 1) when the group shares one selection. ``outside``: None, or a bool mask broadcastable to the output
        (in practice ``[B, Hkv, 1, 1, N]``: the positions outside every cluster), True where the score is -inf.
        A selector may override it to fuse the reduction and the mask."""
        B, Hq, T, _ = query.shape
        scores = self.score(query, index, keys, scale).view(B, keys.shape[1], Hq // keys.shape[1], T, -1)
        scores = scores.amax(dim=2, keepdim=True) if shared else scores
        return scores if outside is None else scores.masked_fill(outside, float("-inf"))

    def sample_pool(self, query: Tensor, index: Any, keys: Tensor, scale: float) -> Tensor | None:
        """``tail: sample``: ln p_i, the log probability that token i is in the pool the tail samples are drawn
        from, ``[B, Hq, T, N]`` (-inf: not in the pool). None: every unread token, p = 1 (uniform sampling).

        The pipeline draws m tokens uniformly from the unread part of the pool and weights each η_i = |pool|/m · 1/p_i
        (Horvitz–Thompson), so the estimate stays unbiased when the pool is itself random (LSH candidates)."""
        return None

    def select(self, scores: Tensor, assignment: Tensor, quotas: Tensor, width: int | None = None,
               members: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Per-cluster top-q_b by score.

        scores ``[B, Hkv, Gs, T, N]`` (-inf outside R), assignment ``[B, Hkv, N]`` (C outside R), quotas
        ``[..., C]`` → positions ``[B, Hkv, Gs, T, K]``, padded with -1; K = ``width`` (a bound on Σ_b q_b known on
        the host, so that nothing waits on the device), or the largest Σ_b q_b when None. ``members``: the clusters'
        positions and sizes (``oa_core.selection.cluster_members``); with them and a width, CUDA tensors are
        selected by a Triton kernel that reads each cluster's scores instead of sorting the row (same set).
        """
        if members is not None and width is not None and scores.is_cuda:
            from oa_core.selection import select_per_cluster, triton

            if triton is not None:
                return select_per_cluster(scores, *members, quotas, width)
        num_tokens = scores.shape[-1]
        num_clusters = quotas.shape[-1]
        # Order positions by score, then (stably) by cluster: each cluster's tokens become one run, best first.
        by_score = scores.argsort(dim=-1, descending=True, stable=True)
        cluster = assignment[:, :, None, None, :].expand_as(scores).gather(-1, by_score)
        by_cluster = cluster.argsort(dim=-1, stable=True)
        ranked = by_score.gather(-1, by_cluster)
        cluster = cluster.gather(-1, by_cluster)
        sizes = torch.zeros(*assignment.shape[:2], num_clusters + 1, dtype=torch.long, device=scores.device)
        sizes.scatter_add_(-1, assignment, torch.ones_like(assignment))
        starts = (sizes.cumsum(-1) - sizes)[:, :, None, None, :].expand(*scores.shape[:-1], -1)
        rank = torch.arange(num_tokens, device=scores.device) - starts.gather(-1, cluster)
        quota = torch.cat([quotas, torch.zeros_like(quotas[..., :1])], dim=-1).gather(-1, cluster)
        taken = positions(rank < quota, width)
        return ranked.gather(-1, taken.clamp_min(0)).masked_fill(taken < 0, -1)


def positions(mask: Tensor, width: int | None = None) -> Tensor:
    """``[..., N]`` bool → the True positions in order ``[..., K]``, padded with -1; K = ``width`` (at least every
    row's count) or, when None, the largest count."""
    if width is None:
        width = int(mask.sum(-1).max()) if mask.numel() else 0
    return compact(torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape), mask, width)


def compact(values: Tensor, keep: Tensor, width: int) -> Tensor:
    """``values`` ``[..., N]`` (integer) where ``keep`` → those kept, in order, ``[..., width]``, padded with -1."""
    width = min(width, values.shape[-1])
    # The k-th kept value goes to slot k (a running count, no sort); the rest to a spare slot, dropped.
    slot = keep.long().cumsum(-1) - 1
    slot = torch.where(keep & (slot < width), slot, width)
    out = torch.full((*values.shape[:-1], width + 1), -1, dtype=values.dtype, device=values.device)
    return out.scatter_(-1, slot, values)[..., :width]


@dataclass
class Selection:
    """The exact rows a kernel reads: ``index`` ``[B, Hkv, Gs, T, K]`` (-1 = padding) and ``log_weight`` (same
    shape): 0 for exact rows, ln η for rows standing in for others (sampled tail rows).

    ``runs`` ``[B, Hkv, Gs, T, C + 1]`` int32, when the pipeline knows the layout: index columns
    ``runs[c] .. runs[c + 1]`` hold cluster c's selected rows, and the columns before ``runs[0]`` and from ``runs[C]``
    on hold rows outside every cluster (sink, local window, tail samples, padding). A kernel then builds each
    cluster's proxy from its run alone. None: the layout is unknown."""

    index: Tensor
    log_weight: Tensor
    runs: Tensor | None = None

    @property
    def valid(self) -> Tensor:
        return self.index >= 0


@dataclass
class PooledClusters:
    """Per-cluster pooled sums: ``count`` ``[B, Hkv, C]``, ``key_sum``, ``value_sum``, ``key_square_sum``
    ``[B, Hkv, C, D]`` (float32), and the cluster ``assignment`` ``[B, Hkv, N]`` (C outside R) with which a kernel
    subtracts the rows it reads exactly."""

    count: Tensor
    key_sum: Tensor
    value_sum: Tensor
    assignment: Tensor
    key_square_sum: Tensor | None = None


class Kernel(Component):
    """Attention over the exact rows plus one count-aware proxy per cluster (DESIGN.md §1 step 7)."""

    def attend(self, query: Tensor, keys: Tensor, values: Tensor, selection: Selection | None,
               proxies: PooledClusters | None, scale: float) -> tuple[Tensor, Tensor | None]:
        """query ``[B, Hq, T, D]``, keys/values ``[B, Hkv, N, D]``; ``selection`` None means every row (dense).

        → (output ``[B, Hq, T, D]`` in the query's dtype, number of proxies used ``[B, Hkv, Gs, T]`` or None).
        """
        raise NotImplementedError


KINDS: dict[str, type[Component]] = {
    "clusterer": Clusterer,
    "selector": Selector,
    "allocator": Allocator,
    "kernel": Kernel,
}
