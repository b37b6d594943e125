"""Diagnostics of one attend call beyond the output error (docs/design.md §1).

- ``estimator_weights``: the estimator's unnormalised per-token weights ŵ_i (exact and sampled rows e^{z_i}·η_i, a
  proxy's tail tokens g_T = e^{s·q·k̄_T}, times 1 + σ̂_T²/2 for a second-order proxy, discarded or unsampled tokens
  0) beside the true w_i = e^{z_i}; the output
  is Σŵ_i v_i / Σŵ_i, and E = Σ|ŵ_i − w_i| / Σw_i is the weight discrepancy of the paper's Eq. 2.
- ``topk_recall``: the share of the true top-k logits of the clusterable region that the selector ranks within its
  E_sel best scores (paper Table 2: top-32 recall at a read fraction).

ErrorGate's own diagnostic (the rank agreement of its estimate with the true per-cluster discrepancy) lives with
ErrorGate: ``oa_plugins.allocators.errorgate.errorgate_spearman``.

Every function takes a pipeline, the state its ``prepare`` returned and decode queries ``[B, Hq, T, D]`` that see
the whole cache, and returns per (batch row, query head, query) values ``[B, Hq, T]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oa_core.ops.cluster_stats import tail_logit_variance
from oa_core.ops.scatter import count_by_slot, sum_by_slot
from oa_core.pipeline import Pipeline
from oa_core.state import PipelineState


def attention_logits(query: Tensor, state: PipelineState) -> Tensor:
    """s·q·k over every row, float64 ``[B, Hkv, g, T, N]`` (query head h = KV head · g + its place); padding -inf."""
    B, Hq, T, D = query.shape
    Hkv = state.keys.shape[1]
    q = query.double().reshape(B, Hkv, Hq // Hkv, T, D)
    logits = state.scale * torch.einsum("bhgtd,bhnd->bhgtn", q, state.keys.double())
    return logits.masked_fill(~state.valid[:, None, None, None, :], -math.inf)


def attention_weights(query: Tensor, state: PipelineState) -> Tensor:
    """Dense attention weights softmax(s·q·k), float64 ``[B, Hkv, g, T, N]``."""
    return torch.softmax(attention_logits(query, state), -1)


def estimator_weights(pipe: Pipeline, state: PipelineState, query: Tensor) -> tuple[Tensor, Tensor]:
    """(ŵ, w), float64 ``[B, Hkv, g, T, N]``, both relative to e^{max z} per query."""
    logits = attention_logits(query, state)
    top = logits.amax(-1, keepdim=True)
    w = torch.exp(logits - top)
    if state.clusters is None and bool(state.valid.all()):
        return w.clone(), w
    selection = pipe.explain(query, state).selection
    B, Hkv, g, T, N = w.shape
    index = selection.index.clamp_min(0).expand(B, Hkv, g, T, -1)
    valid = selection.valid.expand_as(index)
    read = torch.exp(logits.gather(-1, index) - top + selection.log_weight.double()).masked_fill(~valid, 0)
    w_hat = torch.zeros_like(w).scatter_add_(-1, index, read)
    if pipe.spec.tail != "proxy" or state.clusters is None:
        return w_hat, w

    # Proxies: the pooled sums minus the rows read, the reference kernel's way.
    C, pooled = state.num_clusters, state.cluster_sums
    assignment = pooled.assignment  # [B, Hkv, N]
    cluster = assignment.gather(-1, index.reshape(B, Hkv, -1)).view_as(index).masked_fill(~valid, C)
    read_count = count_by_slot(cluster, C, torch.float64)
    rows = index.reshape(B, Hkv, -1, 1).expand(-1, -1, -1, state.keys.shape[-1])
    keys_read = state.keys.double().gather(2, rows).view(*index.shape, -1) * valid.unsqueeze(-1)
    read_key = sum_by_slot(cluster, keys_read, C)
    tail_count = pooled.count.double()[:, :, None, None] - read_count
    tail_key = (pooled.key_sum.double()[:, :, None, None] - read_key) / tail_count.clamp_min(1).unsqueeze(-1)
    q = query.double().reshape(B, Hkv, g, T, -1)
    tail_logit = state.scale * torch.einsum("bhgtd,bhgtcd->bhgtc", q, tail_key)
    if pipe.spec.proxy == "second-order":  # each tail token's share of the proxy: e^{s·q·k̄_T}·(1 + σ̂_T²/2)
        assert pooled.key_square_sum is not None  # a prepared state pools the squares too
        read_logits = logits.gather(-1, index).masked_fill(~valid, 0.0)
        tail_var = tail_logit_variance(
            q,
            read_logits,
            cluster,
            pooled.count.double(),
            pooled.key_sum.double(),
            pooled.key_square_sum.double(),
            tail_count,
            state.scale,
        )
        tail_logit = tail_logit + torch.log1p(0.5 * tail_var)
    per_token = torch.exp(tail_logit - top)  # g_T per cluster
    per_token = torch.cat([per_token, torch.zeros_like(per_token[..., :1])], -1)  # slot C: not in a cluster
    tokens = per_token.gather(-1, assignment[:, :, None, None, :].expand(B, Hkv, g, T, N))
    unread = ~_was_read(selection, w.shape) & (assignment < C)[:, :, None, None, :]
    return torch.where(unread, tokens, w_hat), w


def exact_reads(pipe: Pipeline, state: PipelineState, query: Tensor) -> Tensor:
    """The rows each query reads exactly (sink, local, selected and sampled), bool ``[B, Hkv, g, T, N]``."""
    B, Hq, T, _ = query.shape
    B, Hkv, N, _ = state.keys.shape
    return _was_read(pipe.explain(query, state).selection, (B, Hkv, Hq // Hkv, T, N))


def _was_read(selection, shape: tuple[int, ...]) -> Tensor:
    """A Selection's valid rows as a bool mask of ``shape`` ``[B, Hkv, g, T, N]``."""
    index = selection.index.clamp_min(0).expand(*shape[:-1], -1)
    valid = selection.valid.expand_as(index)
    return torch.zeros(shape, device=index.device).scatter_add_(-1, index, valid.float()) > 0


def weight_discrepancy(pipe: Pipeline, state: PipelineState, query: Tensor) -> Tensor:
    """E = Σ_i |ŵ_i − w_i| / Σ_i w_i, ``[B, Hq, T]``."""
    w_hat, w = estimator_weights(pipe, state, query)
    return ((w_hat - w).abs().sum(-1) / w.sum(-1)).flatten(1, 2)


def topk_recall(pipe: Pipeline, state: PipelineState, query: Tensor, k: int = 32) -> Tensor | None:
    """Share of the true top-``k`` logits of the clusterable region that the selector ranks within its E_sel best
    scores (E_sel = budget − sink − local of each row), ``[B, Hq, T]``; None when every row is dense."""
    if state.clusters is None:
        return None
    scores = pipe.explain(query, state).scores  # [B, Hkv, Gs, T, N], -inf outside the clusters
    assert scores is not None  # a state with clusters is scored
    logits = attention_logits(query, state)
    clustered = (state.cluster_sums.assignment < state.num_clusters)[:, :, None, None, :]
    truth = logits.masked_fill(~clustered, -math.inf).topk(min(k, logits.shape[-1]), dim=-1).indices
    exact = state.exact_rows().sum(-1)  # [B, Hkv]
    budget = (pipe.spec.budget.rows(state.valid.sum(-1))[:, None] - exact).clamp_min(0)
    ranked = scores.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(ranked).scatter_(-1, ranked, torch.arange(ranked.shape[-1]).expand_as(ranked))
    chosen = rank < budget[:, :, None, None, None]
    hit = chosen.expand(*logits.shape).gather(-1, truth)
    return hit.double().mean(-1).flatten(1, 2)
