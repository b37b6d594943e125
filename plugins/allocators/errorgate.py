"""ErrorGate — budget allocation by estimated proxy error (OpenAttention paper, §3.3, Eqs. 6–7).

Under a Gaussian model of the logits inside cluster b, the weight discrepancy its proxy leaves is
ε̂_b = n_b e^{z̄_b} e^{σ̂_b²/2} (2Φ(σ̂_b) − 1) (Eq. 6). The selectable budget is water-filled in proportion to it,
q_b = min(n_b, λ ε̂_b / max ε̂) with Σ q_b = E_sel (Eq. 7). Everything is in log space: e^{z̄_b} overflows.

With a GQA group sharing one selection, each head's ε̂ is divided by its Gaussian estimate of the partition function
Ẑ = Σ_b n_b e^{z̄_b + σ̂_b²/2} (so it becomes that head's relative error, Eq. 3) and the heads' shares are summed.

On CUDA tensors all of it — the priority, the sum over the group and the water-filling — is one Triton kernel, a
program per selection row (``allocate_triton``); on the CPU the torch ops below run, the reference.

``errorgate_spearman`` measures how well ε̂_b ranks the clusters by the error their proxies really leave.
"""

from __future__ import annotations

import contextlib
import math

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from oa_core import hookimpl
from oa_core.analysis.metrics import attention_logits
from oa_core.components import AllocationInput
from oa_core.ops import triton_path
from oa_core.ops.cluster_stats import cluster_logit_stats
from oa_core.ops.scatter import sum_by_slot
from oa_core.ops.selection import top_counts
from oa_core.ops.triton_path import libdevice, tl, triton
from oa_core.ops.water_filling import WaterFillAllocator, launch_config, log_total, triton_applies, water_fill
from oa_core.state import PipelineState

if triton is not None:
    from oa_core.ops.water_filling import water_fill_row  # a Triton function, defined where Triton is


def log_error_estimate(mean_logit: Tensor, logit_var: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """(ln ε̂_b, ln of the cluster's Gaussian mass n_b e^{z̄_b + σ̂_b²/2}), both ``[..., C]``. Empty clusters: -inf."""
    sigma = logit_var.sqrt()
    log_mass = torch.log(counts) + mean_logit + logit_var / 2
    # 2Φ(σ) − 1 = erf(σ/√2); a cluster of identical logits (σ = 0) has no error.
    return log_mass + torch.log(torch.erf(sigma / math.sqrt(2))), log_mass


class ErrorGateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    floor: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="share of the budget read first as the globally "
        "best-scored rows, the rest water-filled (default 0.5; 0: the paper's ErrorGate, 1: global "
        "top-k)",
    )


class ErrorGate(WaterFillAllocator):
    """ErrorGate: water-fill the budget in proportion to each proxy's estimated error (paper Eqs. 6–7)."""

    name = "errorgate"
    Config = ErrorGateConfig
    config: ErrorGateConfig

    @property
    def reads_scores(self) -> bool:
        return self.config.floor > 0

    def log_priority(self, inputs: AllocationInput, counts: Tensor) -> Tensor:
        log_error, log_mass = log_error_estimate(inputs.mean_logit, inputs.logit_var, counts)
        return log_error - log_total(log_mass)

    def allocate(self, inputs: AllocationInput) -> Tensor:
        """With ``floor`` f > 0, first the ⌊f·E_sel⌋ best-scored rows of the row wherever they are (a cluster's
        first reads remove most of its error, and a lone high logit — a needle — may sit in a cluster of low ε̂),
        then the rest of the budget water-filled by ε̂ (Eq. 7) up to what each cluster has left unread."""
        if self.config.floor == 0:
            if fused_applies(inputs):
                return allocate_triton(inputs)
            return super().allocate(inputs)
        counts = inputs.counts[:, :, None, None, :]
        first_budget = torch.floor(self.config.floor * inputs.budget.double()).long()
        width = math.floor(self.config.floor * inputs.width) if inputs.width is not None else None
        first = top_counts(inputs.scores, inputs.assignment, first_budget, counts.shape[-1], width)
        priority = inputs.combine_heads(self.log_priority(inputs, counts))
        rest = water_fill(priority, counts - first, inputs.budget - first.sum(-1))
        return first + rest

    @classmethod
    def diagnose(cls, pipe, state: PipelineState, query: Tensor) -> dict[str, Tensor]:
        spearman = errorgate_spearman(state, query)
        if spearman is None:
            return {}
        return {"errorgate_spearman": spearman[0], "errorgate_spearman_full_variance": spearman[1]}


# True: ErrorGate runs the fused kernel on CPU tensors too when Triton's interpreter is on (tests that exercise the
# GPU path on the CPU set it; by default the CPU runs the torch ops, the interpreter being far slower).
INTERPRET_ON_CPU = False


def fused_applies(inputs: AllocationInput, on_cpu: bool | None = None) -> bool:
    """Whether ``allocate_triton`` serves these inputs: the Triton path applies to their device and size (on the
    CPU: ``on_cpu``, default INTERPRET_ON_CPU, and the interpreter), and the statistics are float32 (what the kernel
    computes in, as torch does for float32 inputs)."""
    on_cpu = INTERPRET_ON_CPU if on_cpu is None else on_cpu
    return (
        triton_applies(inputs.mean_logit, on_cpu)
        and inputs.mean_logit.dtype == torch.float32
        and inputs.logit_var.dtype == torch.float32
        and inputs.counts.dtype == torch.float32
    )


def allocate_triton(inputs: AllocationInput) -> Tensor:
    """``ErrorGate.allocate`` in one Triton kernel (no host-device sync: capturable in a CUDA graph): per selection
    row, each head's ln ε̂_b − ln Ẑ in float32 (the torch ops' arithmetic), their logsumexp over the group when it
    shares the selection, then ``water_fill_row`` in float64. Reads the inputs through their strides."""
    mean, var, counts = inputs.mean_logit, inputs.logit_var, inputs.counts
    B, Hkv, g, T, C = mean.shape
    Gs = inputs.scores.shape[2]
    G = g // Gs  # query heads per selection row
    budget = torch.as_tensor(inputs.budget, device=mean.device)
    budget = budget.view(*budget.shape, *([1] * (4 - budget.dim()))).expand(B, Hkv, Gs, T)
    out = torch.empty(B, Hkv, Gs, T, C, dtype=torch.long, device=mean.device)
    rows = B * Hkv * Gs * T
    if rows and C:
        block, warps = launch_config(C)
        with quiet_interpreter():
            _errorgate[(rows,)](
                mean,
                var,
                counts,
                budget,
                out,
                *mean.stride(),
                *var.stride(),
                *counts.stride(),
                *budget.stride(),
                Hkv,
                Gs,
                T,
                C,
                G=G,
                BLOCK_G=triton.next_power_of_2(G),
                BLOCK_C=block,
                LIBDEVICE=libdevice is not None and not triton_path.interpreting(),
                num_warps=warps,
            )
    return out


def quiet_interpreter():
    """Triton's interpreter runs the kernel in numpy, which warns at ln 0 and ∞ − ∞ (meant: -inf, NaN discarded)."""
    if not triton_path.interpreting():
        return contextlib.nullcontext()
    import numpy

    return numpy.errstate(divide="ignore", invalid="ignore")


if triton is not None:

    @triton.jit
    def _logsumexp(x, axis: tl.constexpr, LIBDEVICE: tl.constexpr):
        """``torch.logsumexp`` along ``axis``: ln Σ e^{x − m} + m, with m = 0 where the maximum is infinite. e^x is
        libdevice's, as torch's on CUDA (tl.exp lowers to an approximate ex2); Triton's interpreter has no libdevice."""
        top = tl.max(x, axis=axis)
        top = tl.where((top == float("inf")) | (top == float("-inf")), 0.0, top)
        shifted = x - tl.expand_dims(top, axis)
        if LIBDEVICE:  # noqa: SIM108 (Triton: a constexpr branch is compiled only when taken; libdevice may be None)
            terms = libdevice.exp(shifted)
        else:
            terms = tl.exp(shifted)
        return tl.log(tl.sum(terms, axis=axis)) + top

    @triton.jit
    def row_log_priority(mean, var, count, G: tl.constexpr, LIBDEVICE: tl.constexpr):
        """One selection row's ErrorGate priority (shared with the fused decode step): z̄ and σ̂² ``[BLOCK_G, BLOCK_C]``
        of its G heads (0 outside them), counts ``[BLOCK_C]`` (0 outside the clusters) → ln ε̂_b − ln Ẑ, summed over
        the heads (logsumexp) when they share the row, float32 ``[BLOCK_C]`` (-inf: never read)."""
        # log_error_estimate, op by op in float32: ln n + z̄ + σ²/2, and + ln erf(σ/√2) (-inf for σ = 0 or n = 0).
        log_mass = (tl.log(count)[None, :] + mean) + var * 0.5
        sigma = tl.sqrt_rn(var)
        log_error = log_mass + tl.log(tl.erf(tl.div_rn(sigma, 1.4142135623730951)))
        # − log_total: each head's ln Ẑ, 0 for a head with no mass (all -inf).
        total = _logsumexp(log_mass, 1, LIBDEVICE)
        total = tl.where((total > float("-inf")) & (total < float("inf")), total, 0.0)
        log_priority = log_error - total[:, None]
        if G == 1:  # noqa: SIM108 (Triton: a constexpr branch, compiled only when taken)
            row = tl.max(log_priority, axis=0)  # the row's only head
        else:
            row = _logsumexp(log_priority, 0, LIBDEVICE)  # combine_heads
        return row

    @triton.jit
    def _errorgate(
        MEAN,
        VAR,
        COUNT,
        BUDGET,
        OUT,
        sm_b,
        sm_h,
        sm_g,
        sm_t,
        sm_c,
        sv_b,
        sv_h,
        sv_g,
        sv_t,
        sv_c,
        sn_b,
        sn_h,
        sn_c,
        sb_b,
        sb_h,
        sb_s,
        sb_t,
        Hkv,
        Gs,
        T,
        C,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_C: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        p = tl.program_id(0)
        b, h, s, t = (p // (T * Gs * Hkv)).to(tl.int64), (p // (T * Gs)) % Hkv, (p // T) % Gs, p % T
        offs_g = tl.arange(0, BLOCK_G)
        offs_c = tl.arange(0, BLOCK_C)
        ok = offs_c < C
        head = s * G + offs_g
        tile = (offs_g[:, None] < G) & ok[None, :]
        # Outside the row (padding lanes and heads) every input reads 0: an empty cluster, -inf throughout.
        mean = tl.load(
            MEAN + b * sm_b + h * sm_h + t * sm_t + head[:, None] * sm_g + offs_c[None, :] * sm_c, mask=tile, other=0.0
        )
        var = tl.load(
            VAR + b * sv_b + h * sv_h + t * sv_t + head[:, None] * sv_g + offs_c[None, :] * sv_c, mask=tile, other=0.0
        )
        count = tl.load(COUNT + b * sn_b + h * sn_h + offs_c * sn_c, mask=ok, other=0.0)
        row = row_log_priority(mean, var, count, G, LIBDEVICE)
        budget = tl.load(BUDGET + b * sb_b + h * sb_h + s * sb_s + t * sb_t).to(tl.float64)
        quotas = water_fill_row(row.to(tl.float64), count.to(tl.float64), budget, offs_c, ok)
        tl.store(OUT + p.to(tl.int64) * C + offs_c, quotas, mask=ok)


# -- diagnostics -------------------------------------------------------------------------------------------------


def _ranks(values: Tensor) -> Tensor:
    return values.argsort(dim=-1, stable=True).argsort(dim=-1).double()


def _masked_correlation(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    n = mask.sum(-1, keepdim=True).clamp_min(1)
    a = a - (a * mask).sum(-1, keepdim=True) / n
    b = b - (b * mask).sum(-1, keepdim=True) / n
    return (a * b * mask).sum(-1) / ((a * a * mask).sum(-1) * (b * b * mask).sum(-1)).sqrt().clamp_min(1e-300)


def errorgate_spearman(state: PipelineState, query: Tensor) -> tuple[Tensor, Tensor] | None:
    """(Spearman of ε̂_b with the true ε_b, Spearman of ε̂_b with the full-covariance ε̂_b), each ``[B, Hq, T]``,
    over the non-empty clusters of the state's clustering; None when every row is dense."""
    if state.clusters is None:
        return None
    C = state.num_clusters
    logits = attention_logits(query, state)
    top = logits.amax(-1, keepdim=True)
    mean, var = (m.double() for m in state.cluster_moments())
    counts = state.cluster_sums.count.double()[:, :, None, None]
    mean_logit, logit_var = cluster_logit_stats(query, mean, var, state.scale)  # float64: torch
    estimate, _ = log_error_estimate(mean_logit, logit_var, counts)

    assignment = state.cluster_sums.assignment[:, :, None, None, :].expand(*logits.shape)
    proxy = torch.cat([torch.exp(mean_logit - top), torch.zeros_like(top)], -1).gather(-1, assignment)
    gap = (torch.exp(logits - top) - proxy).abs().masked_fill(assignment == C, 0).nan_to_num()
    truth = sum_by_slot(assignment, gap, C)

    # The full covariance's σ_b² = s²·qᵀΣ_b q is the variance of the logits inside the cluster: taken from them.
    z = logits.masked_fill(assignment == C, 0)
    sums = sum_by_slot(assignment, z, C) / counts.clamp_min(1)
    squares = sum_by_slot(assignment, z * z, C) / counts.clamp_min(1)
    full, _ = log_error_estimate(mean_logit, (squares - sums * sums).clamp_min(0), counts)

    nonempty = (counts > 0).expand_as(truth).double()
    low = torch.finfo(torch.float64).min
    ranked = [
        _ranks(x.nan_to_num(nan=low, neginf=low).masked_fill(nonempty == 0, low)) for x in (estimate, truth, full)
    ]
    return (
        _masked_correlation(ranked[0], ranked[1], nonempty).flatten(1, 2),
        _masked_correlation(ranked[0], ranked[2], nonempty).flatten(1, 2),
    )


@hookimpl
def register_allocators(register):
    register(ErrorGate)
