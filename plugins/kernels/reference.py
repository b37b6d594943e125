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
from oa_core.cluster_stats import tail_logit_variance
from oa_core.components import Kernel, PooledClusters, Selection
from oa_core.scatter import count_by_slot, gather_rows, sum_by_slot


class TorchKernel(Kernel):
    """Reference kernel in plain torch (float32 accumulation, any device)."""

    name = "torch"
    priority = 1  # what ``kernel: auto`` falls back to
    proxies = ("second-order", "mean")

    def attend(self, query: Tensor, keys: Tensor, values: Tensor, selection: Selection | None,
               proxies: PooledClusters | None, scale: float) -> tuple[Tensor, Tensor | None]:
        B, Hq, T, D = query.shape
        Hkv = keys.shape[1]
        g = Hq // Hkv
        q = query.float().reshape(B, Hkv, g, T, 1, D)
        if selection is None:
            logits = scale * torch.einsum("bhgtxd,bhnd->bhgtn", q, keys.float())
            out = torch.softmax(logits, dim=-1) @ values.float()[:, :, None]
            return out.reshape(B, Hq, T, D).to(query.dtype), None

        index = selection.index.clamp_min(0)  # [B, Hkv, Gs, T, K]
        rows = index.reshape(B, Hkv, -1)
        k = gather_rows(keys, rows).float().reshape(*index.shape, D)  # the rows read, then cast: not the whole cache
        v = gather_rows(values, rows).float().reshape(*index.shape, D)
        # q [B,Hkv,g,T,1,D] @ k [B,Hkv,Gs,T,D,K]: a shared selection (Gs = 1) broadcasts over the group.
        read_logits = (scale * q @ k.transpose(-1, -2)).squeeze(-2)
        logits = read_logits + selection.log_weight.float()
        logits = logits.masked_fill(~selection.valid, float("-inf"))
        if proxies is None:
            weights = torch.softmax(logits, dim=-1)
            out = (weights.unsqueeze(-2) @ v).squeeze(-2)
            return out.reshape(B, Hq, T, D).to(query.dtype), None

        tail_count, tail_key, tail_value = self._tails(selection, k, v, proxies)
        has_tail = tail_count > 0.5
        n = tail_count.clamp_min(1).unsqueeze(-1)
        proxy_logits = (scale * q @ (tail_key / n).transpose(-1, -2)).squeeze(-2) + torch.log(tail_count.clamp_min(1))
        if proxies.second_order:
            cluster, _ = _read_clusters(selection, proxies)
            proxy_logits = proxy_logits + torch.log1p(0.5 * tail_logit_variance(
                q.squeeze(-2), read_logits, cluster.expand(read_logits.shape), proxies.count, proxies.key_sum,
                proxies.key_square_sum, tail_count, scale))
        proxy_logits = proxy_logits.masked_fill(~has_tail, float("-inf"))
        weights = torch.softmax(torch.cat([logits, proxy_logits], dim=-1), dim=-1)
        out = (weights.unsqueeze(-2) @ torch.cat([v, tail_value / n], dim=-2)).squeeze(-2)
        return out.reshape(B, Hq, T, D).to(query.dtype), has_tail.sum(-1)

    @staticmethod
    def _tails(selection: Selection, k: Tensor, v: Tensor, pooled: PooledClusters):
        """Pooled sums minus the rows read: (n_T ``[B,Hkv,Gs,T,C]``, Σ_T k and Σ_T v ``[B,Hkv,Gs,T,C,D]``)."""
        cluster, C = _read_clusters(selection, pooled)
        expand = (slice(None), slice(None), None, None)
        return (pooled.count[expand] - count_by_slot(cluster, C, k.dtype),
                pooled.key_sum[expand] - sum_by_slot(cluster, k, C),
                pooled.value_sum[expand] - sum_by_slot(cluster, v, C))


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
