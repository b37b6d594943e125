"""Independent references: the method's equations written again from the paper, in float64, for tests.

Each function here restates one equation the way the paper writes it — per token, per cluster, from the keys and
values themselves — and calls nothing of the code it checks (no component, no pooled sums, no shared helper). The
tests and the conformance kit (``oa_core.testing``) hold the fast paths and the torch paths against them, so that a
component that agrees with itself but not with the method fails.

- ``proxy_attention``: the estimator's output with one count-aware mean proxy per cluster's unread tail (Eq. 1), or
  its second-order form (the proxy's weight times 1 + σ̂_T²/2).
- ``cluster_logit_stats``: z̄_b = s·q·k̄_b and σ̂_b² = s²Σ_d q_d² Var_b(k_d) from each cluster's own keys (§3.1).
- ``errorgate_priority``: ErrorGate's ε̂_b (Eq. 6), divided by each head's Gaussian Ẑ and summed over a shared group.
- ``water_fill``: q_b = min(n_b, λ·p_b) with Σ q_b = E, λ found by bisection (Eq. 7); ``rounding_violations``
  checks integer quotas are its largest-remainder rounding.
- ``query_metric``: Φ = K U_r Λ_r^½ from the query second moment (Eq. 4), and ``lloyd_violations`` to check a
  partition is a k-means fixed point in it.
- ``qgs_error_bound``: the exact projected logit s·(U_rᵀq)·(U_rᵀk) and how far int8 codes may move it (Eq. 5).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def proxy_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    index: Tensor | None,
    assignment: Tensor | None,
    num_clusters: int,
    scale: float,
    log_weight: Tensor | None = None,
    second_order: bool = False,
) -> Tensor:
    """The estimator's output (Eq. 1), float64, one query vector at a time.

    query ``[B, Hq, T, D]``, keys/values ``[B, Hkv, N, D]``; ``index`` ``[B, Hkv, Gs, T, K]`` the exact rows X (-1:
    padding; Gs = 1 shares a selection over the GQA group), None for dense attention; ``assignment`` ``[B, Hkv, N]``
    each position's cluster (``num_clusters``: none), None for no proxies (tail discarded); ``log_weight`` like
    ``index``: ln η of a row standing in for others (0: exact). Each cluster b adds one term for its unread tail
    T_b = b \\ X when it is not empty: logit s·q·k̄_T + ln |T_b|, value v̄_T, with k̄_T and v̄_T the tail's own means;
    ``second_order`` adds ln(1 + σ̂_T²/2) to the logit (E_T[e^z] ≈ e^{z̄_T}(1 + Var_T z/2)): the tail's logit variance
    σ̂_T² = (Σ_b z² − Σ_{X∩b} z_i²)/|T_b| − z̄_T², z_i = s·q·k_i and z̄_T = s·q·k̄_T, where the cluster's Σ_b z² is
    |b|·(z̄_b² + σ̂_b²) from its members' mean logit and diagonal logit variance s²·Σ_d q_d²·Var_b(k_d), bounded by
    (min_{X∩b} z_i − z̄_T)² where rows of b were read (0 at least).
    """
    q, k, v = query.double(), keys.double(), values.double()
    B, Hq, T, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    g = Hq // Hkv
    out = torch.empty(B, Hq, T, D, dtype=torch.float64)
    for b in range(B):
        for head in range(Hq):
            h = head // g
            for t in range(T):
                qv = q[b, head, t]
                if index is None:
                    weights = torch.softmax(scale * k[b, h] @ qv, 0)
                    out[b, head, t] = weights @ v[b, h]
                    continue
                s = (head % g) if index.shape[2] > 1 else 0
                rows = index[b, h, s, t]
                keep = rows >= 0
                read = rows[keep]
                logits = [scale * (k[b, h, read] @ qv)]
                if log_weight is not None:
                    logits[0] = logits[0] + log_weight[b, h, s, t][keep].double()
                vals = [v[b, h, read]]
                if assignment is not None:
                    unread = torch.ones(N, dtype=torch.bool)
                    unread[read] = False
                    for c in range(num_clusters):
                        tail = unread & (assignment[b, h] == c)
                        count = int(tail.sum())
                        if count:
                            logit = scale * (k[b, h, tail].mean(0) @ qv) + math.log(count)
                            if second_order:
                                members = k[b, h, assignment[b, h] == c]
                                mean_logit = scale * (members.mean(0) @ qv)
                                logit_var = scale**2 * (qv * qv) @ members.var(0, unbiased=False)
                                read_logits = scale * k[b, h, ~unread & (assignment[b, h] == c)] @ qv
                                tail_mean = logit - math.log(count)
                                variance = (
                                    len(members) * (mean_logit**2 + logit_var) - (read_logits**2).sum()
                                ) / count - tail_mean**2
                                if len(read_logits):  # at most the squared gap to the least logit read
                                    gap = (read_logits.min() - tail_mean).clamp_min(0)
                                    variance = torch.minimum(variance, gap * gap)
                                logit = logit + torch.log1p(0.5 * variance.clamp_min(0))
                            logits.append(logit.view(1))
                            vals.append(v[b, h, tail].mean(0, keepdim=True))
                weights = torch.softmax(torch.cat(logits), 0)
                out[b, head, t] = weights @ torch.cat(vals)
    return out


def cluster_logit_stats(
    query: Tensor, keys: Tensor, assignment: Tensor, num_clusters: int, scale: float
) -> tuple[Tensor, Tensor]:
    """z̄_b = s·q·k̄_b and σ̂_b² = s²·Σ_d q_d²·Var_b(k_d) (population variance of the cluster's keys), float64,
    ``[B, Hkv, g, T, C]`` each, computed from the members of each cluster (0 for an empty cluster)."""
    q, k = query.double(), keys.double()
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    mean = torch.zeros(B, Hkv, num_clusters, D, dtype=torch.float64)
    var = torch.zeros_like(mean)
    for b in range(B):
        for h in range(Hkv):
            for c in range(num_clusters):
                members = k[b, h, assignment[b, h] == c]
                if len(members):
                    mean[b, h, c] = members.mean(0)
                    var[b, h, c] = ((members - members.mean(0)) ** 2).mean(0)
    q = q.view(B, Hkv, g, T, D)
    return (
        scale * torch.einsum("bhgtd,bhcd->bhgtc", q, mean),
        scale**2 * torch.einsum("bhgtd,bhcd->bhgtc", q * q, var),
    )


def errorgate_priority(mean_logit: Tensor, logit_var: Tensor, counts: Tensor, shared: bool) -> Tensor:
    """ErrorGate's priority per selection row, as a natural log, float64.

    mean_logit / logit_var ``[B, Hkv, g, T, C]``, counts ``[B, Hkv, C]`` → ``[B, Hkv, Gs, T, C]``. Per head,
    ε̂_b = n_b e^{z̄_b} e^{σ̂_b²/2} (2Φ(σ̂_b) − 1) (Eq. 6) over that head's Gaussian partition function
    Ẑ = Σ_b n_b e^{z̄_b + σ̂_b²/2} (its relative error, Eq. 3); a group sharing one selection sums its heads' shares.
    Computed with a per-head shift (e^{z̄} overflows): ε̂_b/Ẑ is unchanged by one."""
    z, var = mean_logit.double(), logit_var.double()
    n = counts.double()[:, :, None, None, :].expand_as(z)
    present = n > 0
    exponent = torch.where(present, z + var / 2, torch.full_like(z, -math.inf))
    shift = exponent.amax(-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    mass = torch.where(present, n * torch.exp(exponent - shift), torch.zeros_like(z))  # n_b e^{z̄+σ²/2} / e^{shift}
    phi = 0.5 * (1 + torch.special.erf(var.sqrt() / math.sqrt(2)))  # Φ(σ̂)
    error = mass * (2 * phi - 1)
    total = mass.sum(-1, keepdim=True)
    relative = torch.where(
        total > 0, error / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(error)
    )
    if shared:
        relative = relative.sum(2, keepdim=True)
    return torch.log(relative)


def water_fill(log_priority: Tensor, capacity: Tensor, budget: Tensor | int) -> Tensor:
    """Eq. 7 before rounding: the real quotas x_b = min(n_b, λ·p_b/max p) with Σ x_b = min(E, Σ n_b), float64.

    log_priority ``[..., C]`` (ln p_b, -inf: zero priority), capacity n_b ``[..., C]`` (broadcastable), budget E
    ``[...]`` → ``[..., C]``. λ is found by bisection. Clusters of zero priority take budget only when every other
    cluster is full, then in proportion to their sizes. ``rounding_violations`` checks integer quotas against it."""
    lp = log_priority.double()
    cap = capacity.double().expand_as(lp)
    target = torch.as_tensor(budget, dtype=torch.float64).expand(lp.shape[:-1])
    flat_lp, flat_cap, flat_target = lp.reshape(-1, lp.shape[-1]), cap.reshape(-1, lp.shape[-1]), target.reshape(-1)
    ideal = torch.zeros(flat_lp.shape, dtype=torch.float64)
    for row in range(flat_lp.shape[0]):
        ideal[row] = _water_fill_row(flat_lp[row], flat_cap[row], float(flat_target[row]))
    return ideal.view(lp.shape)


def _water_fill_row(log_priority: Tensor, capacity: Tensor, budget: float) -> Tensor:
    target = min(budget, float(capacity.sum()))
    ideal = torch.zeros_like(capacity)
    finite = log_priority > -math.inf
    p = torch.zeros_like(capacity)
    if finite.any():
        p = torch.where(finite, torch.exp(log_priority - log_priority[finite].max()), p)
    positive = (p > 0) & (capacity > 0)
    first = min(target, float(capacity[positive].sum())) if positive.any() else 0.0
    if first > 0:
        # Bisection on ln λ: f(λ) = Σ_b min(n_b, λ p_b) grows from 0 to Σ n_b, each cluster full once λ ≥ n_b / p_b.
        low, high = -750.0, math.log(float((capacity[positive] / p[positive]).max()))
        for _ in range(200):
            mid = (low + high) / 2
            if float(torch.minimum(capacity, math.exp(mid) * p).sum()) < first:
                low = mid
            else:
                high = mid
        ideal = torch.where(positive, torch.minimum(capacity, math.exp(high) * p), ideal)
    rest = ~positive & (capacity > 0)
    left = target - float(ideal.sum())
    if rest.any() and left > 1e-9:
        ideal = torch.where(rest, capacity * (left / float(capacity[rest].sum())), ideal)
    return ideal


def rounding_violations(quotas: Tensor, ideal: Tensor, capacity: Tensor, tol: float = 1e-6) -> Tensor:
    """Rows ``[...]`` where integer quotas ``[..., C]`` are not a largest-remainder rounding of the real quotas
    ``ideal`` (``water_fill``): each q_b is ⌊x_b⌋ or ⌈x_b⌉ and within [0, n_b], they add up to Σ x_b (rounded), and
    no cluster rounded down (and not full) has a larger fractional part than one rounded up. ``tol`` absorbs float
    rounding, so exact ties may go either way."""
    q, x = quotas.double(), ideal.double()
    cap = capacity.double().expand_as(x)
    floor = torch.floor(x + tol)
    bounded = (q >= 0) & (q <= cap) & (q >= floor) & (q <= torch.ceil(x - tol))
    total = q.sum(-1) == torch.round(x.sum(-1))
    fraction = x - floor
    up = q > floor
    down = (q == floor) & (q < cap)
    lowest_up = torch.where(up, fraction, torch.full_like(fraction, math.inf)).amin(-1)
    highest_down = torch.where(down, fraction, torch.full_like(fraction, -math.inf)).amax(-1)
    ordered = highest_down <= lowest_up + tol
    return ~(bounded.all(-1) & total & ordered)


def query_metric(queries: Tensor, kv_heads: int, rank: int, window: int) -> Tensor:
    """Φ's projection U_r Λ_r^½ (Eq. 4), float64 ``[B, Hkv, D, r]``: the top-r eigenpairs of M = mean of q qᵀ over the
    last ``window`` prefill queries of every head in the KV group (queries ``[B, Hq, M, D]``). Unique up to the signs
    of its columns, which distances do not see."""
    B, Hq, _, D = queries.shape
    g = Hq // kv_heads
    projection = torch.zeros(B, kv_heads, D, rank, dtype=torch.float64)
    for b in range(B):
        for h in range(kv_heads):
            q = queries[b, h * g : (h + 1) * g, -window:].double().reshape(-1, D)
            moment = q.T @ q / len(q)
            eigenvalues, eigenvectors = torch.linalg.eigh(moment)
            top = eigenvalues.argsort(descending=True)[:rank]
            projection[b, h] = eigenvectors[:, top] * eigenvalues[top].clamp_min(0).sqrt()
    return projection


def lloyd_violations(points: Tensor, assignment: Tensor, num_clusters: int, rtol: float = 1e-6) -> Tensor:
    """How many points ``[..., n, r]`` (with cluster ids ``[..., n]``; ``num_clusters``: not clustered) sit closer
    to another cluster's mean than to their own's, beyond a relative tolerance: 0 at a k-means fixed point (Eq. 4's
    a_i = argmin_b ‖φ_i − μ_b‖², μ_b the mean of its members). → ``[...]`` counts."""
    x = points.double()
    inside = assignment < num_clusters
    one_hot = torch.nn.functional.one_hot(assignment.clamp_max(num_clusters), num_clusters + 1)[..., :num_clusters]
    one_hot = one_hot.double()
    sizes = one_hot.sum(-2)
    means = (one_hot.transpose(-1, -2) @ x) / sizes.clamp_min(1)[..., None]
    distance = ((x[..., :, None, :] - means[..., None, :, :]) ** 2).sum(-1)
    distance = distance.masked_fill((sizes == 0)[..., None, :], math.inf)
    own = distance.gather(-1, assignment.clamp_max(num_clusters - 1)[..., None]).squeeze(-1)
    best = distance.amin(-1)
    return ((own > best * (1 + rtol) + 1e-9) & inside).sum(-1)


def qgs_error_bound(query: Tensor, keys: Tensor, basis: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Eq. 5 against exact arithmetic: query ``[B, Hq, T, D]``, keys ``[B, Hkv, N, D]``, basis U_r ``[B, Hkv, D, r]``
    → (s·(U_rᵀq)·(U_rᵀk_i), the largest error symmetric int8 codes may add: s·Σ_r |U_rᵀq|_r · δ_i/2 with
    δ_i = max_r |U_rᵀk_i|_r / 127), both float64 ``[B, Hq, T, N]``."""
    B, Hq, T, D = query.shape
    Hkv = keys.shape[1]
    g = Hq // Hkv
    u = basis.double()
    projected_keys = keys.double() @ u  # [B, Hkv, N, r]
    projected_query = query.double().view(B, Hkv, g * T, D) @ u  # [B, Hkv, g·T, r]
    exact = scale * projected_query @ projected_keys.transpose(-1, -2)
    step = projected_keys.abs().amax(-1) / 127
    bound = scale * projected_query.abs().sum(-1, keepdim=True) * step[:, :, None, :] / 2
    return exact.view(B, Hq, T, -1), bound.view(B, Hq, T, -1)
