"""Theory checks run through the real pipeline (oa.build → prepare → attend), docs/design.md §1 "Identities that must
hold".

1. Eq. 2 of the paper on Gaussian logits: E_d = τ, E_p = τ·erf(σ/√2), E[E_s] = 2τ(1 − m/N).
2. The output-error bound ‖ô − o‖ ≤ (Z/Ẑ)·E·max_i ‖v_i − o‖ on heavy-tailed random inputs.
3. Tail sampling is unbiased for the unnormalised numerator and denominator.

How the estimator's unnormalised per-token weights ŵ_i are read off the pipeline: every kernel output is linear in
the values, ô = Σ_i (ŵ_i/Ẑ) v_i (a proxy contributes e^{ℓ_b} v̄_T = g_T Σ_{i∈T} v_i, i.e. ŵ_i = g_T for its tail
tokens). With one-hot values (token i ↦ e_i) the output coordinate of token i is ŵ_i/Ẑ. Sink and local tokens are
always read exactly (ŵ_i = w_i), which gives Ẑ = Σ_{sink∪local} w_i / Σ_{sink∪local} ô_i and then ŵ = Ẑ·ô.
All weights are taken relative to e^{max z} (a common factor cancels in E, τ and Z/Ẑ).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from scipy import integrate, stats

import oa_core as oa


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Every tensor here is small (head dims ≤ 416, eigh of at most 416×416): intra-op threads only add overhead, and
    on a loaded 2-core machine their spin-waits made one test 100× slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build(**spec):
    return oa.build({"kernel": "torch", **spec})


def _recover(onehot_out: torch.Tensor, logits: torch.Tensor, exact: torch.Tensor):
    """One-hot part of the output ``[..., N]`` and true logits ``[..., N]`` (float64) → (ŵ, w, Ẑ, Z), weights
    relative to e^{max z}. ``exact``: positions always read exactly (sink ∪ local)."""
    w = torch.exp(logits - logits.amax(-1, keepdim=True))
    out = onehot_out.double()
    z_hat = w[..., exact].sum(-1, keepdim=True) / out[..., exact].sum(-1, keepdim=True)
    return out * z_hat, w, z_hat.squeeze(-1), w.sum(-1)


def _exact_positions(n: int, sink: int, local: int) -> torch.Tensor:
    return torch.cat([torch.arange(sink), torch.arange(n - local, n)])


# --------------------------------------------------------------------------------------------------------------------
# 1. Eq. 2 on Gaussian logits
# --------------------------------------------------------------------------------------------------------------------
#
# One KV head, one query head, scale 1 and q = e_0, so z_i = k_{i,0}. The clusterable region R (= the tail T: one
# cluster, budget = sink + local + samples, so E_sel − samples = 0 and nothing is selected) has i.i.d. N(0, σ²)
# logits; sink and local tokens share one logit c chosen so that τ ≈ 1/2 (any τ would do; 1/2 keeps both parts
# visible). For the proxy, N must be large (Eq. 2 for the proxy is the N → ∞ statement), which would need a head dim
# D ≥ N of several thousand for one-hot values. Instead the same keys are repeated over B batch rows and batch row b
# carries the one-hot values of tokens [bD, (b+1)D): rows are independent, and with E_sel = 0 and one cluster the
# exact set and the tail are identical in every row, so the B outputs together give ô_i for all N tokens.

SINK, LOCAL = 4, 60
BLOCK = 128  # head dim of the blocked one-hot values
TAIL = 4096 - SINK - LOCAL  # |T| = 4032 Gaussian tail tokens, N = 4096 = 32 blocks


def _gaussian_logits(n_tail: int, sigma: float, sink: int, local: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tail = sigma * torch.randn(n_tail, generator=gen, dtype=torch.float64)
    # sink/local logit c: (sink + local)·e^c = n_tail·E[e^z] = n_tail·e^{σ²/2}  →  τ ≈ 1/2.
    c = sigma**2 / 2 + math.log(n_tail / (sink + local))
    fixed = torch.full((sink + local,), c, dtype=torch.float64)
    z = torch.cat([fixed[:sink], tail, fixed[sink:]])
    return z.float().double()  # the values the float32 cache really holds


@functools.cache
def _blocked_gaussian_run(tail: str, sigma: float, seed: int, proxy: str = "mean"):
    """→ (ŵ, w, Ẑ, Z, z) over all N tokens, float64, for a pipeline with the given tail treatment (and proxy) and
    E_sel = 0. Cached: the second-order test compares with the mean proxy's run of the same draw (read only)."""
    z = _gaussian_logits(TAIL, sigma, SINK, LOCAL, seed)
    n = z.numel()
    blocks = n // BLOCK
    keys = torch.zeros(blocks, 1, n, BLOCK)
    keys[..., 0] = z.float()
    values = torch.zeros(blocks, 1, n, BLOCK)
    token = torch.arange(n)
    values[token // BLOCK, 0, token, token % BLOCK] = 1.0
    query = torch.zeros(blocks, 1, 1, BLOCK)
    query[..., 0] = 1.0
    pipe = _build(  # no row is selected (E_sel = 0): the exact oracle's index costs nothing to build, PQS's seconds
        clusterer={"name": "qgc", "num_clusters": 1},
        selector={"name": "oracle"},
        tail=tail,
        proxy=proxy,
        budget={"tokens": SINK + LOCAL},
        sink=SINK,
        local=LOCAL,
    )
    state = pipe.prepare(keys, values, query, scale=1.0)
    out = pipe.attend(query, state)  # [blocks, 1, 1, BLOCK]
    assert not bool(state.dense_rows.any())
    o_hat = out[:, 0, 0, :].reshape(-1)  # block b, coordinate j ↦ token b·BLOCK + j
    w_hat, w, z_hat, z_true = _recover(o_hat, z, _exact_positions(n, SINK, LOCAL))
    return w_hat, w, z_hat, z_true, z


def test_eq2_discard_equals_tail_share():
    """E_d = τ exactly, per draw: every tail token gets weight 0 and the exact tokens their own."""
    for sigma in (0.5, 2.0):
        w_hat, w, _, z_true, _ = _blocked_gaussian_run("discard", sigma, seed=11)
        tail = slice(SINK, SINK + TAIL)
        tau = float(w[tail].sum() / z_true)
        error = float((w_hat - w).abs().sum() / z_true)
        assert 0.2 < tau < 0.8  # the set-up is not degenerate
        assert torch.equal(w_hat[tail], torch.zeros(TAIL, dtype=torch.float64))
        # Exact tokens carry a float32 kernel's rounding only: relative ~1e-6 per weight, so E_d − τ ≤ 1e-5.
        assert abs(error - tau) < 1e-5, (sigma, error, tau)


def _proxy_standard_error(sigma: float, n: int) -> float:
    """Standard error of the finite-N ratio Σ_T|g − w_i| / Σ_T w_i around erf(σ/√2) for z ~ N(0, σ²).

    Delta method for a ratio of means: SE = sd(|1 − y| − R·y) / (√n·E[y]) with y = e^z, R = erf(σ/√2) (the term has
    mean 0). Using g = e^{z̄} instead of e^μ = 1 only moves this at second order: d/dc E|e^c − e^z| = 0 at c = μ
    (the median of z), so its effect is O(1/N), not O(1/√N).
    """
    ratio = math.erf(sigma / math.sqrt(2))
    density = stats.norm.pdf

    def term_sq(x):
        y = math.exp(sigma * x)
        return (abs(1 - y) - ratio * y) ** 2 * density(x)

    second, _ = integrate.quad(term_sq, -12, 12, points=[0.0], limit=200)
    return math.sqrt(second / n) / math.exp(sigma**2 / 2)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_eq2_proxy_erf(sigma):
    """E_p = τ·erf(σ/√2) on Gaussian logits with a single count-aware mean proxy g_T = e^{z̄_T}."""
    w_hat, w, _, z_true, z = _blocked_gaussian_run("proxy", sigma, seed=int(100 * sigma))
    tail = slice(SINK, SINK + TAIL)
    # The proxy's per-token weight is g_T = e^{z̄_T} for every tail token (relative to e^{max z}), to float32 rounding
    # (pooled sums in float32 over 4032 keys: relative ~1e-5 at most on z̄_T, so 1e-4 on g_T).
    g = math.exp(float(z[tail].mean() - z.max()))
    assert torch.allclose(w_hat[tail], torch.full((TAIL,), g, dtype=torch.float64), rtol=1e-4, atol=0)

    tau = float(w[tail].sum() / z_true)
    error = float((w_hat - w).abs().sum() / z_true)
    expected = math.erf(sigma / math.sqrt(2))
    se = _proxy_standard_error(sigma, TAIL)
    # 4 SE of the finite-N ratio (two-sided normal tail ~6e-5; in a 400-draw simulation of this statistic at N = 4096
    # its spread matched this SE within ~15%, e.g. σ = 2: sd 0.0047 vs SE 0.0053, and its mean was within 0.001 of
    # erf(σ/√2)), plus 1e-4 for float32. For scale: at σ = 1, 4 SE ≈ 0.026, while e.g. a proxy weighted by the
    # arithmetic mean weight would give E/τ = 2·erf(σ/(2√2)) ≈ 0.77 instead of 0.68.
    assert abs(error / tau - expected) < 4 * se + 1e-4, (sigma, error / tau, expected, se)
    assert error < tau  # the paper's point: a proxy stays below discarding


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_a_second_order_proxy_weighs_each_tail_token_by_one_plus_half_the_variance(sigma):
    """The same Gaussian tail with the second-order proxy: each tail token's weight is e^{z̄_T}(1 + σ̂_T²/2) with σ̂_T²
    the tail's own logit variance (one key dimension: the diagonal is exact, and no tail row is read), so the tail's
    mass is off by (1 + σ̂²/2)/e^{σ²/2} − 1 instead of the mean proxy's e^{−σ²/2} − 1."""
    w_hat, w, _, _, z = _blocked_gaussian_run("proxy", sigma, seed=int(100 * sigma), proxy="second-order")
    tail = slice(SINK, SINK + TAIL)
    variance = float(z[tail].var(unbiased=False))
    g = math.exp(float(z[tail].mean() - z.max())) * (1 + variance / 2)
    assert torch.allclose(w_hat[tail], torch.full((TAIL,), g, dtype=torch.float64), rtol=1e-4, atol=0)
    mass, true_mass = float(w_hat[tail].sum()), float(w[tail].sum())
    mean_w_hat, _, _, _, _ = _blocked_gaussian_run("proxy", sigma, seed=int(100 * sigma))
    mean_mass = float(mean_w_hat[tail].sum())
    assert mean_mass < mass < true_mass  # both below the truth (Jensen; 1 + x ≤ e^x), the second order closer
    assert abs(mass / true_mass - (1 + variance / 2) / math.exp(variance / 2)) < 0.03 + 4 * sigma / math.sqrt(TAIL)


@pytest.mark.parametrize("samples", [10, 40])
def test_eq2_sample_expectation(samples):
    """E[E_s] = 2τ(1 − m/N) for m uniform tail samples weighted η = N/m, by Monte Carlo over the spec's seed."""
    sink, local, n_tail = 4, 28, 160
    z = _gaussian_logits(n_tail, 1.0, sink, local, seed=7)
    n = z.numel()  # 192: one-hot values need D ≥ N
    keys = torch.zeros(1, 1, n, n)
    keys[..., 0] = z.float()
    values = torch.eye(n)[None, None]
    query = torch.zeros(1, 1, 1, n)
    query[..., 0] = 1.0
    exact = _exact_positions(n, sink, local)
    tail = slice(sink, sink + n_tail)
    eta = n_tail / samples

    draws = 100
    errors, tau = [], None
    for seed in range(draws):
        pipe = _build(
            clusterer={"name": "qgc", "num_clusters": 1},
            tail="sample",
            tail_samples=1.0,
            budget={"tokens": sink + local + samples},
            sink=sink,
            local=local,
            seed=seed,
        )
        state = pipe.prepare(keys, values, query, scale=1.0)
        out = pipe.attend(query, state)[0, 0, 0]
        w_hat, w, _, z_true = _recover(out, z, exact)
        tau = float(w[tail].sum() / z_true)
        # Per draw: exactly m tail tokens read, each weighted η = N/m (float32 rounding: 1e-4 relative).
        drawn = w_hat[tail] > 0
        assert int(drawn.sum()) == samples
        assert torch.allclose(
            w_hat[tail][drawn] / w[tail][drawn], torch.full((samples,), eta, dtype=torch.float64), rtol=1e-4
        )
        errors.append(float((w_hat - w).abs().sum() / z_true))

    errors = torch.tensor(errors, dtype=torch.float64)
    expected = 2 * tau * (1 - samples / n_tail)
    se = float(errors.std() / math.sqrt(draws))
    # Eq. 2 for sampling is exact in expectation for any N and any logits (E[Σ_B w] = (m/N)·Σ_T w), so the only
    # slack is Monte Carlo error: 3 standard errors of the mean over independent seeds (the one-cluster clustering
    # does not depend on the seed; samples come from a stream of their own per seed), plus 1e-5 for float32.
    # (m = N/2 would be degenerate: η = 2 makes E_s = τ for every draw.)
    assert abs(float(errors.mean()) - expected) < 3 * se + 1e-5, (float(errors.mean()), expected, se)
    assert se < 0.1 * expected  # the check has power: the Monte Carlo error is small next to the value


# --------------------------------------------------------------------------------------------------------------------
# 2. Output-error bound
# --------------------------------------------------------------------------------------------------------------------


def _heavy_tailed_inputs(seed: int, tokens: int, dim: int, kv_heads: int, group: int):
    """Student-t (3 d.o.f.) keys, values and queries, values = [random | one-hot], keys and queries zero-padded."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        # t_3 = N(0,1) / sqrt(χ²_3 / 3), all from the seeded generator.
        chi2 = (torch.randn(*shape, 3, generator=gen) ** 2).sum(-1)
        return torch.randn(*shape, generator=gen) / (chi2 / 3).sqrt()

    width = dim + tokens
    keys = torch.zeros(1, kv_heads, tokens, width)
    keys[..., :dim] = draw(1, kv_heads, tokens, dim) * 0.6
    values = torch.zeros(1, kv_heads, tokens, width)
    values[..., :dim] = draw(1, kv_heads, tokens, dim)
    values[..., dim:] = torch.eye(tokens)
    heads = kv_heads * group
    prefill = torch.zeros(1, heads, 32, width)
    prefill[..., :dim] = draw(1, heads, 32, dim)
    query = torch.zeros(1, heads, 1, width)
    query[..., :dim] = draw(1, heads, 1, dim) * 0.7
    return keys, values, prefill, query


def _dense_logits(query, keys, scale):
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    return scale * (query.double() @ k.transpose(-1, -2))[:, :, 0]  # [B, Hq, N]


@pytest.mark.parametrize("tail", ["proxy", "discard", "sample"])
def test_output_error_bound(tail):
    """‖ô − o‖ ≤ (Z/Ẑ)·E·max_i ‖v_i − o‖ (docs/design.md §1), default pipeline with several clusters.

    The bound follows from ô − o = (1/Ẑ)Σ_i (ŵ_i − w_i)(v_i − o), which holds when the output is Σ ŵ_i v_i / Σ ŵ_i
    with Ẑ = Σ ŵ_i: the pipeline's proxies must use value sums that match their key sums and counts.
    """
    tokens, dim, kv_heads, group, sink, local = 384, 32, 2, 2, 4, 16
    scale = 1 / math.sqrt(dim)  # the random part's head dim; the one-hot padding does not enter the logits
    exact = _exact_positions(tokens, sink, local)
    checked = 0
    for seed in (0, 1):
        keys, values, prefill, query = _heavy_tailed_inputs(seed, tokens, dim, kv_heads, group)
        logits = _dense_logits(query, keys, scale)
        v = values[..., :dim].double().repeat_interleave(group, dim=1)  # [1, Hq, N, dim]
        o = (torch.softmax(logits, -1).unsqueeze(-2) @ v).squeeze(-2)  # dense, float64
        for density, gqa in ((0.1, "per_head"), (0.3, "per_head"), (0.1, "shared")):
            pipe = _build(
                clusterer={"name": "qgc", "num_clusters": 8},
                tail=tail,
                budget={"density": density},
                sink=sink,
                local=local,
                seed=seed,
                gqa=gqa,
            )
            state = pipe.prepare(keys, values, prefill, scale=scale)
            out = pipe.attend(query, state)[:, :, 0]  # [1, Hq, width]
            o_hat = out[..., :dim].double()
            w_hat, w, z_hat, z_true = _recover(out[..., dim:], logits, exact)
            # Ẑ = Σ ŵ_i: the weights the output is made of are normalised by their own sum (float32: 1e-4).
            assert torch.allclose(w_hat.sum(-1), z_hat, rtol=1e-4)
            error = (w_hat - w).abs().sum(-1) / z_true
            spread = (v - o.unsqueeze(-2)).norm(dim=-1).amax(-1)
            lhs = (o_hat - o).norm(dim=-1)
            rhs = z_true / z_hat * error * spread
            assert float(error.max()) > 1e-2  # a genuinely approximate estimate, so the bound is not vacuous
            # Slack: float32 output and weights, relative 1e-4 of the bound plus 1e-5 absolute (|v| = O(1)).
            assert bool((lhs <= rhs * (1 + 1e-4) + 1e-5).all()), (tail, seed, density, gqa, lhs, rhs)
            checked += lhs.numel()
    assert checked == 2 * 3 * kv_heads * group


# --------------------------------------------------------------------------------------------------------------------
# 3. Tail sampling is unbiased
# --------------------------------------------------------------------------------------------------------------------


def test_tail_sampling_unbiased():
    """E[η Σ_{i∈B} w_i] = Σ_{i∈T} w_i and E[η Σ_{i∈B} w_i v_i] = Σ_{i∈T} w_i v_i, through the default pipeline.

    With tail = sample and tail_samples = 0.5 the selector reads half the selectable budget and the other half are
    uniform samples of the unread tail T. The selection depends on the clustering and so on the seed, hence T does
    too; but the exact parts cancel in Ẑ − Z = η Σ_B w_i − Σ_T w_i, which must have mean 0 over seeds (likewise the
    numerator Ẑ·ô − Σ_i w_i v_i). Each seed gives an independent clustering and an independent sample.
    """
    tokens, dim, sink, local, density = 192, 8, 4, 16, 0.25
    gen = torch.Generator().manual_seed(3)
    keys = torch.zeros(1, 1, tokens, dim + tokens)
    keys[..., :dim] = torch.randn(1, 1, tokens, dim, generator=gen)
    values = torch.zeros(1, 1, tokens, dim + tokens)
    values[..., :dim] = torch.randn(1, 1, tokens, dim, generator=gen)
    values[..., dim:] = torch.eye(tokens)
    prefill = torch.zeros(1, 1, 32, dim + tokens)
    prefill[..., :dim] = torch.randn(1, 1, 32, dim, generator=gen)
    query = torch.zeros(1, 1, 1, dim + tokens)
    query[..., :dim] = torch.randn(1, 1, 1, dim, generator=gen)
    scale = 1 / math.sqrt(dim)
    # A recency trend: logits grow by 3 from the first to the last position along the query's direction, so a
    # sampler biased by position (not only one biased by weight) would bias the estimate.
    q = query[0, 0, 0, :dim]
    trend = torch.linspace(-1.5, 1.5, tokens)  # logit shift s·q·Δk_i
    keys[0, 0, :, :dim] += trend[:, None] * q / (scale * q.dot(q))
    logits = _dense_logits(query, keys, scale)[0, 0]
    exact = _exact_positions(tokens, sink, local)
    region = torch.arange(sink, tokens - local)

    selectable = math.floor(density * tokens) - sink - local
    samples = round(0.5 * selectable)
    selected = selectable - samples
    eta = (region.numel() - selected) / samples

    draws = 100
    den, num = [], []
    for k in range(draws):
        pipe = _build(
            clusterer={"name": "qgc", "num_clusters": 8},
            tail="sample",
            tail_samples=0.5,
            budget={"density": density},
            sink=sink,
            local=local,
            seed=k,
        )
        state = pipe.prepare(keys, values, prefill, scale=scale)
        out = pipe.attend(query, state)[0, 0, 0]
        w_hat, w, z_hat, z_true = _recover(out[dim:], logits, exact)
        # Per draw: the selector's rows carry weight w_i, the samples η·w_i with η = N_T/m, N_T = |R| − selected.
        ratio = w_hat[region] / w[region]
        read = ratio > 0
        is_sample = ratio > 1.5  # η ≈ 11.3 here, exact rows 1
        assert int(read.sum()) == selectable and int(is_sample.sum()) == samples
        assert torch.allclose(ratio[read & ~is_sample], torch.ones(selected, dtype=torch.float64), rtol=1e-4)
        assert torch.allclose(ratio[is_sample], torch.full((samples,), eta, dtype=torch.float64), rtol=1e-4)
        v = values[0, 0, :, :dim].double()
        den.append(float(z_hat - z_true) / float(z_true))
        num.append((z_hat * out[:dim].double() - w @ v) / z_true)

    # In units of Z (a constant: the logits do not change between draws).
    den = torch.tensor(den, dtype=torch.float64)
    num = torch.stack(num)
    # Denominator: 3 standard errors of the mean over independent draws.
    se = float(den.std() / math.sqrt(draws))
    assert abs(float(den.mean())) < 3 * se, (float(den.mean()), se)
    # Power: SE ≈ 0.013·Z here, so a bias of ~5% of Z fails (a sampler favouring early positions did).
    assert se < 0.03
    # Numerator, one test per value coordinate: Bonferroni over the `dim` coordinates so that the family keeps the
    # false-alarm rate of a single 3-SE test (two-sided 0.27%): z* = Φ⁻¹(1 − 0.00135/dim) ≈ 3.6 for dim = 8.
    z_star = float(stats.norm.ppf(1 - 0.00135 / dim))
    se_num = num.std(0) / math.sqrt(draws)
    assert bool((num.mean(0).abs() < z_star * se_num).all()), (num.mean(0), se_num)


@pytest.mark.parametrize("proxy", ["mean", "second-order"])
def test_the_estimators_per_token_weights_give_the_kernels_output(proxy):
    """metrics.estimator_weights (E, the paper's Eq. 2) measures the estimator the kernel computes: Σŵ_i v_i / Σŵ_i
    over every token is the attend output, for either proxy."""
    from oa_core.analysis.metrics import estimator_weights

    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 300, 16, generator=gen), torch.randn(1, 2, 300, 16, generator=gen)
    prefill = torch.randn(1, 4, 40, 16, generator=gen)
    decode = 1.5 * keys[:, [0, 0, 1, 1], -3:] + 0.3 * torch.randn(1, 4, 3, 16, generator=gen)
    pipe = oa.build(
        {
            "kernel": "torch",
            "proxy": proxy,
            "budget": {"density": 0.1},
            "sink": 4,
            "local": 16,
            "clusterer": {"name": "qgc", "num_clusters": 8},
        }
    )
    state = pipe.prepare(keys, values, prefill)
    out = pipe.attend(decode, state)
    w_hat, _ = estimator_weights(pipe, state, decode)
    estimate = (w_hat.unsqueeze(-1) * values.double()[:, :, None, None]).sum(-2) / w_hat.sum(-1, keepdim=True)
    assert torch.allclose(estimate.reshape(out.shape), out.double(), atol=1e-5)
