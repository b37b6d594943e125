"""Quest — query-aware page selection (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", ICML 2024).

The context is cut into pages of S consecutive tokens; each page keeps the element-wise minimum and maximum of its
keys. A query bounds every logit in a page by s·Σ_d max(q_d·min_d, q_d·max_d) (≥ s·q·k_i for each key of the page),
and every token takes its page's bound as its score, so a page's tokens rank together and are read together: with
the ``global`` allocator the E_sel best scores are whole pages (the last one possibly cut), which is Quest.

Pages start at the first clusterable position of each row (so a left-padded row pages its tokens exactly as it would
alone) and run on through the local window and decode-time tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Clusters, Selector


class QuestConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    page_size: int = Field(default=16, ge=1, description="S: tokens per page (Quest: 16)")


@dataclass
class QuestIndex:
    start: Tensor  # [B, 1, 1] first paged position of each row (N for rows with nothing to page)
    page_min: Tensor  # [B, Hkv, P, D] float32
    page_max: Tensor  # [B, Hkv, P, D] float32
    num_tokens: int


class QuestSelector(Selector):
    """Quest: per-page min/max keys, the page's logit upper bound as the score of each of its tokens."""

    name = "quest"
    Config = QuestConfig
    config: QuestConfig

    def scoring_bytes(self, head_dim: int) -> float:
        return 2 * 2 * head_dim / self.config.page_size  # a page's min and max keys in bf16, over its tokens

    def build(
        self, keys: Tensor, queries: Tensor | None, clusters: Clusters, generator: torch.Generator | None = None
    ) -> QuestIndex:
        B, Hkv, N, D = keys.shape
        region = clusters.assignment[:, 0] < clusters.num_clusters  # [B, N], the same for every KV head
        first = torch.where(
            region.any(-1), region.float().argmax(-1), torch.full_like(region[:, 0], N, dtype=torch.long)
        )
        empty = keys.new_zeros(B, Hkv, 0, D, dtype=torch.float32)
        return self.extend(QuestIndex(first.view(B, 1, 1), empty, empty, 0), keys)

    def _pages(self, index: QuestIndex, positions: Tensor) -> Tensor:
        """Positions ``[n]`` → page ids ``[B, 1, n]``; −1 before a row's first paged position."""
        offset = positions.view(1, 1, -1) - index.start
        return torch.where(offset >= 0, offset // self.config.page_size, -1)

    def extend(self, index: QuestIndex, keys: Tensor) -> QuestIndex:
        B, Hkv, t, D = keys.shape
        n = index.num_tokens + t
        pages = self._pages(index, torch.arange(index.num_tokens, n, device=keys.device))
        num_pages = max(index.page_min.shape[2], int(pages.max()) + 1 if pages.numel() else 0)
        grow = num_pages - index.page_min.shape[2]
        page_min = torch.cat([index.page_min, keys.new_full((B, Hkv, grow, D), math.inf, dtype=torch.float32)], 2)
        page_max = torch.cat([index.page_max, keys.new_full((B, Hkv, grow, D), -math.inf, dtype=torch.float32)], 2)
        # Rows before a row's first page go to a spare slot, dropped after the reduction.
        slot = pages.masked_fill(pages < 0, num_pages).expand(B, Hkv, t).unsqueeze(-1).expand(B, Hkv, t, D)
        spare = keys.new_zeros(B, Hkv, 1, D, dtype=torch.float32)
        page_min = torch.cat([page_min, spare], 2).scatter_reduce(2, slot, keys.float(), "amin")[:, :, :num_pages]
        page_max = torch.cat([page_max, spare], 2).scatter_reduce(2, slot, keys.float(), "amax")[:, :, :num_pages]
        return QuestIndex(index.start, page_min, page_max, n)

    def page_bounds(self, query: Tensor, index: QuestIndex, scale: float) -> Tensor:
        """query ``[B, Hkv, Gs, G, T, D]`` → s·Σ_d max(q_d·min_d, q_d·max_d) per page, ``[B, Hkv, g·T, P]`` (rows:
        head, query)."""
        B, Hkv = query.shape[:2]
        q = query.float().reshape(B, Hkv, -1, query.shape[-1])
        # max(q·lo, q·hi) = q⁺·hi + q⁻·lo. Pages not yet holding a key have ±inf bounds: zeroed, never gathered.
        lo = torch.nan_to_num(index.page_min, posinf=0.0)
        hi = torch.nan_to_num(index.page_max, neginf=0.0)
        return scale * (q.clamp_min(0) @ hi.transpose(-1, -2) + q.clamp_max(0) @ lo.transpose(-1, -2))

    def score(self, query: Tensor, index: QuestIndex, keys: Tensor, scale: float) -> Tensor:
        B, Hkv, Gs, G, T, _ = query.shape
        N = index.num_tokens
        bounds = self.page_bounds(query, index, scale)  # [B, Hkv, g·T, P]
        pages = self._pages(index, torch.arange(N, device=query.device))  # [B, 1, N]
        per_token = bounds.gather(
            -1, pages.clamp_min(0).expand(*bounds.shape[:2], N).unsqueeze(2).expand(*bounds.shape[:3], N)
        )
        per_token = per_token.masked_fill((pages < 0).unsqueeze(2), -math.inf)
        return per_token.view(B, Hkv, Gs, G, T, N).amax(3)


@hookimpl
def register_selectors(register):
    register(QuestSelector)
