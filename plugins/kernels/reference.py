"""The torch reference kernel: docs/design.md step 7 written plainly, in float32, for any device.

Output = (Σ_X e^{z_i} v_i + Σ_b e^{ℓ_b} v̄_T) / (Σ_X e^{z_i} + Σ_b e^{ℓ_b}), one max-subtracted softmax over the
exact rows X and one proxy per cluster whose tail T_b = b \\ X is not empty. The proxy is built from the pooled sums
minus the rows read: n_T = n_b − |X∩b|, k̄_T = (Σk_b − Σ_{X∩b} k_i)/n_T, v̄_T likewise, ℓ_b = s·q·k̄_T + ln n_T;
second-order proxies add ln(1 + σ̂_T²/2), the tail's logit variance: the cluster's, σ̂_b² = s²·Σ_d q_d²·Var_b(k_d)
(cluster_stats' diagonal estimate), with the rows read taken out exactly — σ̂_T² = (n_b·σ̂_b² − D2 − D1²/n_T)/n_T with
D1 = Σ_{X∩b} (z_i − z̄_b), D2 = Σ_{X∩b} (z_i − z̄_b)², z_i = s·q·k_i, z̄_b = s·q·k̄_b. Nothing is recomputed over the
tail. Rows carry a log weight (ln η for sampled tail rows, 0 otherwise).
"""

from __future__ import annotations

import torch
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Kernel, PooledClusters, Selection
from oa_core.ops.cluster_stats import tail_logit_variance
from oa_core.ops.scatter import count_by_slot, gather_rows, gathers_more_than_it_holds, sum_by_slot


class TorchKernel(Kernel):
    """Reference kernel in plain torch (float32 accumulation, any device)."""

    name = "torch"
    priority = 1  # what ``kernel: auto`` falls back to
    proxies = ("second-order", "mean")

    def attend(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        selection: Selection | None,
        proxies: PooledClusters | None,
        scale: float,
    ) -> tuple[Tensor, Tensor | None]:
        B, Hq, T, D = query.shape
        Hkv = keys.shape[1]
        g = Hq // Hkv
        q = query.float().reshape(B, Hkv, g, T, 1, D)
        if selection is None:
            logits = scale * torch.einsum("bhgtxd,bhnd->bhgtn", q, keys.float())
            out = torch.softmax(logits, dim=-1) @ values.float()[:, :, None]
            return out.reshape(B, Hq, T, D).to(query.dtype), None

        index = selection.index.clamp_min(0)  # [B, Hkv, Gs, T, K]
        read_logits, weighted = _rows_read(q, keys, values, index, scale)
        logits = read_logits + selection.log_weight.float()
        logits = logits.masked_fill(~selection.valid, float("-inf"))
        if proxies is None:
            out = weighted(torch.softmax(logits, dim=-1))
            return out.reshape(B, Hq, T, D).to(query.dtype), None

        # The tails through the rows' logits, never their key or value vectors: with z_i = s·q·k_i,
        # s·q·k̄_T = (s·q·Σk_b − Σ_{X∩b} z_i)/n_T, and a proxy's weight w_b on v̄_T = (Σv_b − Σ_{X∩b} v_i)/n_T is
        # c_b = w_b/n_T on Σv_b and −c_b on each row read from b.
        cluster, C = _read_clusters(selection, proxies)  # [B, Hkv, Gs, T, K]
        heads = cluster.expand(read_logits.shape)  # [B, Hkv, g, T, K]
        expand = (slice(None), slice(None), None, None)
        read_count, read_sum, leaves = self._taken(cluster, heads, read_logits, C)
        tail_count = proxies.count[expand] - read_count  # [B, Hkv, Gs, T, C]
        has_tail = tail_count > 0.5
        n = tail_count.clamp_min(1)
        q = q.squeeze(-2)  # [B, Hkv, g, T, D]
        tail_sum = scale * torch.einsum("bhgtd,bhcd->bhgtc", q, proxies.key_sum) - read_sum
        proxy_logits = tail_sum / n + torch.log(n)
        if proxies.second_order:
            assert proxies.key_square_sum is not None  # second-order proxies come with it (PooledClusters)
            proxy_logits = proxy_logits + torch.log1p(
                0.5
                * tail_logit_variance(
                    q, read_logits, heads, proxies.count, proxies.key_sum, proxies.key_square_sum, tail_count, scale
                )
            )
        proxy_logits = proxy_logits.masked_fill(~has_tail, float("-inf"))
        weights = torch.softmax(torch.cat([logits, proxy_logits], dim=-1), dim=-1)
        share = weights[..., logits.shape[-1] :] / n  # c_b
        row_weights = weights[..., : logits.shape[-1]] - torch.cat(
            [share, torch.zeros_like(share[..., :1])], -1
        ).gather(-1, leaves)
        out = weighted(row_weights) + torch.einsum("bhgtc,bhcd->bhgtd", share, proxies.value_sum)
        return out.reshape(B, Hq, T, D).to(query.dtype), has_tail.sum(-1)

    @staticmethod
    def _taken(cluster: Tensor, heads: Tensor, read_logits: Tensor, C: int) -> tuple[Tensor, Tensor, Tensor]:
        """What the rows read take out of their clusters' tails: (how many ``[B, Hkv, Gs, T, C]``, the sum of their
        logits ``[B, Hkv, g, T, C]``, the cluster each row's value leaves ``[B, Hkv, g, T, K]``, C for none)."""
        return count_by_slot(cluster, C, read_logits.dtype), sum_by_slot(heads, read_logits, C), heads


def _rows_read(q: Tensor, keys: Tensor, values: Tensor, index: Tensor, scale: float):
    """The rows ``index`` ``[B, Hkv, Gs, T, K]`` of each query ``q`` ``[B, Hkv, g, T, 1, D]`` (a shared selection,
    Gs = 1, serves the whole group) → (their logits s·q·k_i ``[B, Hkv, g, T, K]``, and ``weighted``: weights of
    the rows ``[B, Hkv, g, T, K]`` → Σ_i w_i v_i ``[B, Hkv, g, T, D]``). The rows are gathered, then cast (a cast of
    the whole cache would read and write all of it); where a KV head's queries read more rows between them than its
    cache holds (several queries, as a question's causal block), the cache is read once instead: every logit in one
    product, the weights scattered over the positions for one product with the values (on 2 CPU cores, 16 queries
    of 9 heads reading 430 of 4,096 rows: 1.3 against 4.3 ms)."""
    B, Hkv, g, T, _, D = q.shape
    K, N = index.shape[-1], keys.shape[2]
    if not gathers_more_than_it_holds(index.shape[2] * T * K, keys):
        rows = index.reshape(B, Hkv, -1)
        k = gather_rows(keys, rows).float().reshape(*index.shape, D)
        v = gather_rows(values, rows).float().reshape(*index.shape, D)
        # q [B,Hkv,g,T,1,D] @ k [B,Hkv,Gs,T,D,K]: a shared selection (Gs = 1) broadcasts over the group.
        return (scale * q @ k.transpose(-1, -2)).squeeze(-2), lambda w: (w.unsqueeze(-2) @ v).squeeze(-2)
    index = index.expand(B, Hkv, g, T, K)
    logits = scale * q.reshape(B, Hkv, g * T, D) @ keys.float().transpose(-1, -2)

    def weighted(w: Tensor) -> Tensor:  # padding (position 0, weight 0) adds nothing
        spread = torch.zeros(B, Hkv, g, T, N, dtype=w.dtype, device=w.device).scatter_add_(-1, index, w)
        return (spread.view(B, Hkv, g * T, N) @ values.float()).view(B, Hkv, g, T, D)

    return logits.view(B, Hkv, g, T, N).gather(-1, index), weighted


def _read_clusters(selection: Selection, pooled: PooledClusters) -> tuple[Tensor, int]:
    """The cluster of each row read, ``selection.index``'s shape (C for padding and rows outside every cluster), and
    the number of clusters C."""
    C = pooled.count.shape[-1]
    B, Hkv = pooled.assignment.shape[:2]
    cluster = pooled.assignment.gather(-1, selection.index.clamp_min(0).reshape(B, Hkv, -1))
    return cluster.reshape(selection.index.shape).masked_fill(~selection.valid, C), C


@hookimpl
def register_kernels(register):
    register(TorchKernel)
