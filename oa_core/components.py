"""The four component kinds and the plain-tensor records that pass between them.

Shapes follow transformers: ``[B, H, N, D]`` (batch, heads, tokens, head dim). ``Hkv`` is the number of KV heads,
``Hq = g * Hkv`` the number of query heads, ``T`` the number of decode queries and ``C`` the number of clusters.
Selection runs per *selection head*: ``Gs = g`` heads per KV head (``gqa: per_head``) or ``Gs = 1`` shared by the
group (``gqa: shared``), so every per-query tensor below is ``[B, Hkv, Gs, T, ...]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

if TYPE_CHECKING:
    from oa_core.spec import PipelineSpec


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

    @classmethod
    def diagnose(cls, pipe: Any, state: Any, query: Tensor) -> dict[str, Tensor]:
        """Measurements this component's idea makes on any pipeline's prepared state for decode queries
        ``[B, Hq, T, D]`` (e.g. how well ErrorGate's estimate ranks the clusters, whatever the allocator), each
        ``[B, Hq, T]`` under a name of its own; {} where it has none or they do not apply. ``oa eval
        --diagnostics`` asks every registered component."""
        return {}


@dataclass
class Clusters:
    """A clusterer's output for the clusterable region R of one layer.

    ``assignment``: ``[B, Hkv, N]`` cluster ids in ``[0, num_clusters)`` on R, ``num_clusters`` elsewhere.
    ``space``: whatever the clusterer's ``assign`` needs to place new tokens (projection, centroids).
    """

    assignment: Tensor
    num_clusters: int
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
    """Splits the selectable budget E_sel over clusters (docs/design.md, step 5).

    ``reads_scores``: whether ``allocate`` reads ``inputs.scores`` (global top-k does; water-filling by a
    per-cluster priority does not, and the fast decode path then skips setting the positions outside the clusters to
    -inf)."""

    @property
    def reads_scores(self) -> bool:  # a property: whether it does may depend on the config (ErrorGate's floor)
        return True

    def allocate(self, inputs: AllocationInput) -> Tensor:
        """→ quotas q_b, integer ``[B, Hkv, Gs, T, C]`` with q_b ≤ n_b and Σ_b q_b = min(E_sel, Σ_b n_b)."""
        raise NotImplementedError


class Selector(Component):
    """Scores keys cheaply, so that the pipeline reads each cluster's q_b best (docs/design.md, steps 3 and 6).

    Queries reach ``score`` and ``sample_pool`` grouped as ``[B, Hkv, Gs, G, T, D]`` (``group_queries``): per KV head,
    Gs selection heads, each shared by G query heads (G = 1 with ``gqa: per_head``, the whole group with ``shared``).
    """

    def build(self, keys: Tensor, queries: Tensor | None, clusters: Clusters, generator: torch.Generator) -> Any:
        """Once per request: keys ``[B, Hkv, N, D]``, prefill queries ``[B, Hq, M, D]`` or None → an index (plain
        tensors). ``generator``: a CPU generator seeded from the spec, for selectors that draw (LSH hyperplanes)."""
        return None

    def extend(self, index: Any, keys: Tensor) -> Any:
        """Decode-time growth: index the new keys ``[B, Hkv, t, D]`` appended after the old ones. By default the
        per-token fields of ``token_codes`` are appended (the index unchanged when there are none)."""
        codes = self.token_codes(index, keys)
        if not codes:
            return index
        return dataclasses.replace(
            index, **{name: torch.cat([getattr(index, name), new], 2) for name, new in codes.items()}
        )

    def token_codes(self, index: Any, keys: Tensor) -> dict[str, Tensor] | None:
        """What the index keeps per token, for keys ``[B, Hkv, t, D]``: the index's own field names → tensors with the
        token dim at 2 (so that the fast decode path holds each at its capacity and writes new tokens in place); {}
        when it keeps nothing per token (the oracle). None, the default: the index is not of that form (growth then
        needs ``extend`` overridden, and the fast path does not apply)."""
        return None

    def scoring_bytes(self, head_dim: int) -> float | None:
        """What ``score`` reads per key, in bytes, where a deployment keeps keys in bf16 (2·D bytes each): its codes
        or bounds, for a budget's arithmetic of what a step reads. None: not stated."""
        return None

    def score(self, query: Tensor, index: Any, keys: Tensor, scale: float) -> Tensor:
        """query ``[B, Hkv, Gs, G, T, D]`` → approximate logits ``[B, Hkv, Gs, T, N]`` (float32): for each selection
        head, the largest over its G query heads (any order-preserving score will do: only the ranking matters)."""
        raise NotImplementedError

    @property
    def refines(self) -> bool:
        """Whether ``refine`` changes the scores (the fast decode path then masks them and calls it)."""
        return False

    def refine(
        self, scores: Tensor, query: Tensor, index: Any, keys: Tensor, scale: float, budget: Tensor, width: int
    ) -> Tensor:
        """The scores the allocator and the selection use, from ``score``'s (-inf where not selectable) once each
        row's selectable budget ``[B, Hkv, 1, 1]`` is known (at most ``width``, on the host): by default unchanged;
        a two-stage selector re-ranks a shortlist by exact logits here (``oa_core.ops.rerank``)."""
        return scores

    def sample_pool(self, query: Tensor, index: Any, keys: Tensor, scale: float) -> Tensor | None:
        """``tail: sample``: ln p_i, the log probability that token i is in the pool the tail samples are drawn
        from, ``[B, Hkv, Gs, G, T, N]`` for query ``[B, Hkv, Gs, G, T, D]`` (-inf: not in the pool). None: every
        unread token, p = 1 (uniform sampling).

        The pipeline draws m tokens uniformly from the unread part of the pool and weights each η_i = |pool|/m · 1/p_i
        (Horvitz–Thompson), so the estimate stays unbiased when the pool is itself random (LSH candidates)."""
        return None


def group_queries(query: Tensor, kv_heads: int, shared: bool) -> Tensor:
    """``[B, Hq, T, D]`` → the view ``[B, Hkv, Gs, G, T, D]`` selectors take: query head h·g + j of KV head h is
    selection head j // G's member j % G (Gs = 1, G = g when ``shared``; Gs = g, G = 1 otherwise)."""
    B, Hq, T, D = query.shape
    g = Hq // kv_heads
    return query.view(B, kv_heads, 1 if shared else g, g if shared else 1, T, D)


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
    subtracts the rows it reads exactly.

    ``second_order``: the proxy a kernel builds from them (docs/design.md, step 7). False: the paper's mean proxy,
    ℓ_b = s·q·k̄_T + ln n_T. True: ℓ_b + ln(1 + σ̂_T²/2), the second-order term of E_T[e^z] around z̄_T, with σ̂_T²
    the tail's logit variance: the cluster's diagonal one (from ``key_square_sum``) with the rows read taken out."""

    count: Tensor
    key_sum: Tensor
    value_sum: Tensor
    assignment: Tensor
    key_square_sum: Tensor | None = None
    second_order: bool = False

    def __post_init__(self) -> None:
        if self.second_order and self.key_square_sum is None:
            raise ValueError("second-order proxies need the pooled key_square_sum")


class Kernel(Component):
    """Attention over the exact rows plus one count-aware proxy per cluster (docs/design.md, step 7).

    ``kernel: auto`` takes, among the registered kernels that apply on the device, the one of highest ``priority``.
    """

    priority: ClassVar[int] = 0
    # The proxies it computes (``PooledClusters.second_order``): a spec asking for another is refused when built.
    proxies: ClassVar[tuple[str, ...]] = ("mean",)

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        """Why this kernel can't run on tensors of ``device`` (None: it can)."""
        return None

    def attend(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        selection: Selection | None,
        proxies: PooledClusters | None,
        scale: float,
    ) -> tuple[Tensor, Tensor | None]:
        """query ``[B, Hq, T, D]``, keys/values ``[B, Hkv, N, D]``; ``selection`` None means every row (dense).

        → (output ``[B, Hq, T, D]`` in the query's dtype, number of proxies used ``[B, Hkv, Gs, T]`` or None).
        """
        raise NotImplementedError

    def static_step(self, state: Any) -> Any:
        """The fast decode path's whole step for a ``StaticState`` of this pipeline, fused: a callable
        ``(state, query, keys, values) → output`` doing what ``StaticState.step`` does in fewer launches; None, the
        default, where this kernel has none for the pipeline's components (the state then composes their steps)."""
        return None


KINDS: dict[str, type[Component]] = {
    "clusterer": Clusterer,
    "selector": Selector,
    "allocator": Allocator,
    "kernel": Kernel,
}


class Composition(Protocol):
    """What a pipeline state reads of the pipeline that made it: the spec and the four components. ``Pipeline`` is
    one; the state names this instead so that it need not import the pipeline that imports it."""

    spec: PipelineSpec
    clusterer: Clusterer
    selector: Selector
    allocator: Allocator
    kernel: Kernel
