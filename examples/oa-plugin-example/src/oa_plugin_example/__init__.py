"""An OpenAttention plugin package: one component of each kind, each a baseline worth having in experiments.

- ``random`` clusterer: clusters with no structure at all (a seeded random partition), to measure how much the
  proxies owe to good clusters.
- ``key-norm`` selector: scores keys by their norm alone, ignoring the query (one float per key, the cheapest
  selector there is), to measure what query-aware selection buys.
- ``proportional`` allocator: quotas in proportion to cluster sizes (every cluster read at the same rate).
- ``float64`` kernel: the count-aware proxy attention in float64, for error measurements below float32 rounding.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from oa_core import Allocator, Clusterer, Clusters, Kernel, Selector, hookimpl


class RandomConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_clusters: int = Field(default=64, ge=1, description="clusters per (batch row, KV head)")


class RandomClusterer(Clusterer):
    """Random: a seeded random partition of the region (no structure); new keys join the nearest cluster mean."""

    name = "random"
    Config = RandomConfig

    def fit(self, keys: Tensor, queries: Tensor | None, mask: Tensor, generator: torch.Generator) -> Clusters:
        B, H, N, _ = keys.shape
        C = self.config.num_clusters
        ids = torch.randint(C, (B, H, N), generator=generator).to(keys.device)  # drawn on the CPU: same everywhere
        ids = ids.masked_fill(~mask[:, None, :], C)
        one_hot = torch.nn.functional.one_hot(ids, C + 1)[..., :C].float()
        means = one_hot.transpose(-1, -2) @ keys.float() / one_hot.sum(2).clamp_min(1).unsqueeze(-1)
        return Clusters(ids, C, space=means)

    def assign(self, clusters: Clusters, keys: Tensor) -> Tensor:
        return torch.cdist(keys.float(), clusters.space).argmin(-1)


class KeyNormSelector(Selector):
    """Key norm: the largest keys first, whatever the query."""

    name = "key-norm"

    def build(self, keys, queries, clusters, generator=None) -> Tensor:
        return keys.float().norm(dim=-1)  # [B, Hkv, N]

    def extend(self, index: Tensor, keys: Tensor) -> Tensor:
        return torch.cat([index, keys.float().norm(dim=-1)], dim=2)

    def score(self, query: Tensor, index: Tensor, keys: Tensor, scale: float) -> Tensor:
        B, Hkv, Gs, G, T, _ = query.shape
        return index[:, :, None, None, :].expand(B, Hkv, Gs, T, -1).contiguous()


class ProportionalAllocator(Allocator):
    """Proportional: quotas in proportion to cluster sizes, largest remainders first."""

    name = "proportional"

    def allocate(self, inputs) -> Tensor:
        counts = inputs.counts[:, :, None, None, :].double()  # [B, Hkv, 1, 1, C]
        heads = inputs.mean_logit.shape[2] if not inputs.shared else 1
        counts = counts.expand(*counts.shape[:2], heads, inputs.mean_logit.shape[3], -1)
        target = torch.minimum(inputs.budget.double()[..., None], counts.sum(-1, keepdim=True))
        share = counts * target / counts.sum(-1, keepdim=True).clamp_min(1)
        quotas = share.floor()
        left = (target - quotas.sum(-1, keepdim=True)).round().long()
        rank = (share - quotas).argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        return quotas.long() + (rank < left).long()


class Float64Kernel(Kernel):
    """Float64: the exact rows plus one count-aware proxy per cluster, accumulated in float64."""

    name = "float64"
    proxies = ("second-order", "mean")  # the proxies it computes (``PooledClusters.second_order``)

    def attend(self, query, keys, values, selection, proxies, scale):
        B, Hq, T, D = query.shape
        H = keys.shape[1]
        q = query.double().view(B, H, 1, Hq // H, T, D)  # [B, H, 1, g, T, D]: the selection heads broadcast
        k, v = keys.double(), values.double()
        if selection is None:
            logits = scale * torch.einsum("bhsgtd,bhnd->bhsgtn", q, k)
            out = torch.einsum("bhsgtn,bhnd->bhsgtd", logits.softmax(-1), v)
            return out.reshape(B, Hq, T, D).to(query.dtype), None
        Gs = selection.index.shape[2]
        q = q.view(B, H, Gs, Hq // H // Gs, T, D)
        index = selection.index.clamp_min(0)  # [B, H, Gs, T, K]
        rows = index.flatten(2)
        k_read = k.gather(2, rows[..., None].expand(-1, -1, -1, D)).view(*index.shape, D)
        v_read = v.gather(2, rows[..., None].expand(-1, -1, -1, D)).view(*index.shape, D)
        logits = scale * torch.einsum("bhsgtd,bhstkd->bhsgtk", q, k_read) + selection.log_weight.double()[:, :, :, None]
        logits = logits.masked_fill(~selection.valid[:, :, :, None], float("-inf"))
        parts_logit, parts_value = [logits], [v_read[:, :, :, None].expand(*logits.shape, D)]
        used = None
        if proxies is not None:
            C = proxies.count.shape[-1]
            ids = proxies.assignment.gather(2, rows).view(index.shape).masked_fill(~selection.valid, C)
            one_hot = torch.nn.functional.one_hot(ids, C + 1)[..., :C].double()  # [B, H, Gs, T, K, C]
            n = proxies.count.double()[:, :, None, None] - one_hot.sum(-2)  # tail sizes [B, H, Gs, T, C]
            k_tail = proxies.key_sum.double()[:, :, None, None] - one_hot.transpose(-1, -2) @ k_read
            v_tail = proxies.value_sum.double()[:, :, None, None] - one_hot.transpose(-1, -2) @ v_read
            mean_k, mean_v = k_tail / n.clamp_min(1)[..., None], v_tail / n.clamp_min(1)[..., None]
            proxy = scale * torch.einsum("bhsgtd,bhstcd->bhsgtc", q, mean_k) + n.clamp_min(1).log()[:, :, :, None]
            if proxies.second_order:  # + ln(1 + σ̂_T²/2): the cluster's diagonal logit variance minus the rows read,
                count = proxies.count.double()[..., None]
                mean_b = proxies.key_sum.double() / count.clamp_min(1)
                var_b = (proxies.key_square_sum.double() / count.clamp_min(1) - mean_b ** 2).clamp_min(0)
                centre = scale * torch.einsum("bhsgtd,bhcd->bhsgtc", q, mean_b)
                logit_var = scale ** 2 * torch.einsum("bhsgtd,bhcd->bhsgtc", q * q, var_b)
                raw = scale * torch.einsum("bhsgtd,bhstkd->bhsgtk", q, k_read)
                deviation = raw - torch.einsum("bhsgtc,bhstkc->bhsgtk", centre, one_hot)
                d1 = torch.einsum("bhsgtk,bhstkc->bhsgtc", deviation, one_hot)
                d2 = torch.einsum("bhsgtk,bhstkc->bhsgtc", deviation ** 2, one_hot)
                tail = n.clamp_min(1)[:, :, :, None]
                variance = ((proxies.count.double()[:, :, None, None, None] * logit_var - d2 - d1 ** 2 / tail)
                            / tail).clamp_min(0)
                # at most (M_b − z̄_T)², M_b the least logit read from the cluster (+inf: none read)
                least = torch.where(one_hot.bool()[:, :, :, None], raw[..., None], torch.inf).amin(-2)
                gap = (least - (centre - d1 / tail)).clamp_min(0)
                variance = torch.minimum(variance, gap * gap)
                proxy = proxy + torch.log1p(0.5 * variance)
            proxy = proxy.masked_fill(~(n > 0.5)[:, :, :, None], float("-inf"))
            parts_logit.append(proxy)
            parts_value.append(mean_v[:, :, :, None].expand(*proxy.shape, D))
            used = (n > 0.5).sum(-1)
        weights = torch.cat(parts_logit, -1).softmax(-1)
        out = (weights[..., None] * torch.cat(parts_value, -2)).sum(-2)  # [B, H, Gs, g, T, D]
        return out.reshape(B, Hq, T, D).to(query.dtype), used


@hookimpl
def register_clusterers(register):
    register(RandomClusterer)


@hookimpl
def register_selectors(register):
    register(KeyNormSelector)


@hookimpl
def register_allocators(register):
    register(ProportionalAllocator)


@hookimpl
def register_kernels(register):
    register(Float64Kernel)
