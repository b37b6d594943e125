"""Position blocks (the paper's Table 1 ablation; Quest-like pages): contiguous runs of the clusterable positions, by
block size or by block count — no look at the keys at all."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Clusterer, Clusters


class PositionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    block_size: int | None = Field(default=None, ge=1, description="tokens per block")
    num_blocks: int | None = Field(default=None, ge=1, description="blocks per row (default 64 if neither is given)")

    @model_validator(mode="after")
    def _at_most_one(self) -> PositionConfig:
        if self.block_size is not None and self.num_blocks is not None:
            raise ValueError("give block_size or num_blocks, not both")
        return self


class PositionBlocks(Clusterer):
    """Position blocks: contiguous runs of positions (by size or count)."""

    name = "position"
    Config = PositionConfig
    config: PositionConfig

    def fit(self, keys: Tensor, queries: Tensor | None, mask: Tensor, generator: torch.Generator) -> Clusters:
        B, H, N, _ = keys.shape
        lengths = mask.sum(-1, keepdim=True)  # [B, 1] clusterable positions per row
        rank = mask.cumsum(-1) - 1  # position of each token within its row's region
        if self.config.block_size is not None:
            size = torch.full_like(lengths, self.config.block_size)
            num_clusters = max(1, -(-int(lengths.max()) // self.config.block_size))
        else:
            num_clusters = max(1, min(self.config.num_blocks or 64, int(lengths.max())))
            size = (lengths + num_clusters - 1) // num_clusters  # ceil: every row fits in num_clusters blocks
        block = (rank // size.clamp_min(1)).masked_fill(~mask, num_clusters)
        last = (lengths - 1).clamp_min(0) // size.clamp_min(1)  # the block new tokens join: the newest one
        return Clusters(block[:, None, :].expand(B, H, N).clone(), num_clusters, space=last.view(B, 1, 1))

    def assign(self, clusters: Clusters, keys: Tensor) -> Tensor:
        return clusters.space.expand(*keys.shape[:3]).clone()


@hookimpl
def register_clusterers(register):
    register(PositionBlocks)
