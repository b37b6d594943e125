"""OpenAttention.flash — Triton decode kernels for docs/design.md step 7.

Per selection row p (a batch row, KV head, selection head and query) the exact rows X_p are read by index and the G
query heads that share the selection (the whole GQA group with ``gqa: shared``, one head otherwise) are served by
each row read. A selection from the pipeline lists each cluster's selected rows as one run (``Selection.runs``); one
without runs is regrouped by cluster first. One launch (``flash_programs.py``); each KV byte is read once:

1. ``sparse_pass``, flash-decoding style: a program per (row, part) gathers its columns' keys and values, takes
   z_i = s·q·k_i + ln η_i and keeps its part of the softmax (a running max, Σe^{z_i}, Σe^{z_i}·v_i). With proxies
   a part per chunk of 16 clusters holds the chunk's runs and proxies and an even share of the columns outside the
   runs (the sink, the local window, padding); without, a few parts split every column evenly. Reading a chunk's
   runs it also sums, per cluster, the rows read — their count, Σ_{X∩b} s·q·k_i and Σ_{X∩b} v_i, as products with the
   columns' one-hot clusters (one cluster after another would be latency-bound) — and then, with the pooled sums,
   needs no key or value again: n_T = n_b − |X∩b|, ℓ_b = (s·q·Σk_b − Σ_{X∩b} s·q·k_i)/n_T + ln n_T, and the
   tail's part e^{ℓ_b} over the softmax's denominator, e^{ℓ_b}·(Σv_b − Σ_{X∩b} v_i)/n_T over its numerator.
   Second-order proxies also sum Σ_{X∩b} (s·q·k_i)² and add ln(1 + σ̂_T²/2) to ℓ_b: the cluster's logit variance
   (from the pooled Σk and Σk⊙k) with the rows read taken out, as the reference kernel has it.
2. the merge (``merge_row``), by the row's last part to finish — each part counts its arrival on a counter per row
   that starts at zero (an atomic that publishes its stores) — instead of a launch of its own: the parts rescaled to
   one max, summed, divided, written in the query's layout and dtype.

The programs form one 1-D grid with the selection row varying fastest (keeping a row's programs together was
slower).

Inputs may be float32, float16 or bfloat16; accumulation is float32. 16-bit inputs use tensor-core dots for q·k, e·v
and the one-hot sums of v; everything else (and float32 inputs throughout) uses ``ieee`` float32 dots, no TF32.
Where there is no CUDA device (and no ``TRITON_INTERPRET=1``) or no Triton, ``attend`` runs the torch reference and
says why in ``note``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Kernel, PooledClusters, Selection
from oa_core.ops import triton_path
from oa_core.ops.triton_path import triton
from oa_plugins.kernels.reference import TorchKernel

if triton is not None:
    from oa_plugins.kernels.flash_programs import sparse_pass


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(int(n)))


def block_columns(block_d: int) -> int:
    """Index columns per block of the pass at head dim ``block_d``: 64 up to 64, else 16. A program holds a block's
    keys and values, ``[BLOCK_K, BLOCK_D]`` each. At D = 256 and 64 columns ptxas (sm_90) spilled 18 KB a thread in
    float32 (0.9 KB in bf16; 6.7 KB at D = 128), a stack the driver reserves for every resident thread: ten processes
    running Gemma-3-270M's RULER 16K ran the H200 out of memory loading the kernel. 16 columns spill 1.2 KB at
    D = 256 and 0.4 KB at D = 128 in float32 (0.06 and 0 in bf16), as 64 columns do at D = 64
    (``benchmarks/studies/kernel_resources.py``)."""
    return 64 if block_d <= 64 else 16


def cluster_runs(selection: Selection, assignment: Tensor, num_clusters: int) -> Selection:
    """A selection regrouped by cluster, with its ``runs``: each row's index stably sorted by the cluster of its
    positions (rows outside every cluster and padding last), for a selection that does not say how it is laid out."""
    B, Hkv = assignment.shape[:2]
    index = selection.index
    cluster = assignment.gather(-1, index.clamp_min(0).reshape(B, Hkv, -1)).reshape(index.shape)
    cluster = cluster.masked_fill(index < 0, num_clusters)
    cluster, order = cluster.sort(dim=-1, stable=True)
    bounds = torch.arange(num_clusters + 1, device=index.device).expand(*index.shape[:-1], -1).contiguous()
    runs = torch.searchsorted(cluster.contiguous(), bounds).to(torch.int32)
    return Selection(index.gather(-1, order), selection.log_weight.gather(-1, order), runs)


class FlashKernel(Kernel):
    """OpenAttention.flash: Triton decode kernels over the exact rows and one proxy per cluster."""

    name = "flash"
    priority = 10  # ``kernel: auto`` takes it wherever it runs: on CUDA
    proxies = ("second-order", "mean")
    block_k: int | None = None  # index columns per block; None: ``block_columns(D)``
    clusters_per_chunk: int | None = None  # clusters per program (a power of two ≥ 16); None: 16
    free_splits: int | None = None  # programs per row without proxies; None: from the shape
    num_warps: int | None = None  # warps per program of the pass; None: Triton's default (4)
    # Pipelining stages of the pass's loops (None: Triton's default, 3 on the H200). 2 was 3-5% faster than 3 at every
    # benchmark shape on the H200, 8 warps 1.7x slower (benchmarks/studies/results/flash_launch_h200.json).
    num_stages: int | None = 2
    poison = False  # fill the output buffers with NaN before launching (tests: every element must be written)

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.note = ""

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if triton is None:
            return "triton is not installed"
        return None if device.type == "cuda" else "no CUDA device"

    def attend(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        selection: Selection | None,
        proxies: PooledClusters | None,
        scale: float,
    ) -> tuple[Tensor, Tensor | None]:
        reason = triton_path.unavailable_reason(query.device)
        if reason is not None:
            self.note = f"torch reference: {reason}"
            return TorchKernel().attend(query, keys, values, selection, proxies, scale)
        if selection is None:  # dense: the fused SDPA of torch
            self.note = "dense: torch SDPA"
            out = torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, scale=scale, enable_gqa=keys.shape[1] != query.shape[1]
            )
            return out, None
        self.note = "triton" + (" (interpreter)" if triton_path.interpreting() else "")
        return self.sparse(query, keys, values, selection, proxies, scale)

    def static_step(self, state):
        """``flash_step.FusedStep``: the whole step in a few launches, where the pipeline's other components
        are the components it fuses (QGC, QGS or PQS, ErrorGate) and the state's device runs Triton; else None."""
        from oa_plugins.kernels.flash_step import FusedStep, fused_unsupported

        return FusedStep(state) if fused_unsupported(state) is None else None

    def sparse(
        self,
        query,
        keys,
        values,
        selection,
        proxies,
        scale,
        arrivals: Tensor | None = None,
        logit_stats: tuple[Tensor, Tensor] | None = None,
    ):
        """``attend`` with a selection, on Triton. ``arrivals``: int32 zeros, one per selection row, that the pass
        counts its parts on (the fused step's plan zeroes them: no launch of their own); None: zeros made here.
        ``logit_stats``: the clusters' z̄_b and σ̂_b² per query head, float32 ``[B, Hkv, Hq / Hkv, 1, C]`` (the fused
        step's prologue computes them for its allocation), for one query per row: the proxies then read no Σk and
        no Σk⊙k, a third of their bytes where they would read all three."""
        B, Hq, T, D = query.shape
        Hkv = keys.shape[1]
        Gs = selection.index.shape[2]
        G = Hq // Hkv // Gs  # query heads served by each selection
        P = B * Hkv * Gs * T
        device = query.device
        if query.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
            query, keys, values = query.contiguous(), keys.contiguous(), values.contiguous()
        proxy = proxies is not None
        C = proxies.count.shape[-1] if proxy else 0
        if proxy and selection.runs is None:
            selection = cluster_runs(selection, proxies.assignment, C)
        ksel = selection.index.shape[-1]
        index = selection.index.reshape(P, ksel).contiguous()
        log_weight = selection.log_weight.float().reshape(P, ksel).contiguous()
        if proxy:
            runs = selection.runs.to(torch.int32).reshape(P, C + 1).contiguous()
            key_sum, value_sum = proxies.key_sum.float().contiguous(), proxies.value_sum.float().contiguous()
            count = proxies.count.float().contiguous()
            second = proxies.second_order
            key_square_sum = proxies.key_square_sum.float().contiguous() if second else key_sum
        else:
            runs = key_sum = value_sum = count = key_square_sum = log_weight  # unused placeholders
            second = False
        stats = logit_stats if proxy else None  # (without proxies nothing reads them)
        if stats is not None:
            mean_logit, logit_var = (t.contiguous() for t in stats)
            if T != 1 or mean_logit.shape != (B, Hkv, Hq // Hkv, 1, C) or mean_logit.dtype != torch.float32:
                raise ValueError(
                    f"flash: logit_stats must be float32 [{B}, {Hkv}, {Hq // Hkv}, 1, {C}] for one query a row, got "
                    f"{mean_logit.dtype} {list(mean_logit.shape)} for {T} queries"
                )
        else:
            mean_logit = logit_var = log_weight  # unused placeholders

        block_g, block_d = _pow2(G), _pow2(D)
        block_k = self.block_k or block_columns(block_d)
        chunk_c = self.clusters_per_chunk or 16
        # The parts of a row. With proxies a program per chunk of clusters, which also share the columns outside the
        # runs (the sink, the window, padding): at low densities a chunk's first block holds its runs and its share.
        # Without, splits of every column: about 2048 programs in all (to hide the gathers' latency), each at least a
        # block.
        if proxy:
            parts = max(1, triton.cdiv(C, chunk_c))
        else:
            parts = self.free_splits or max(1, min(triton.cdiv(ksel, block_k), triton.cdiv(2048, P)))

        def empty(*shape, dtype=torch.float32):  # buffers every element of which the kernels write
            if self.poison:
                return torch.full(shape, -1 if dtype == torch.int32 else math.nan, dtype=dtype, device=device)
            return torch.empty(shape, dtype=dtype, device=device)

        row_max, den, acc = empty(P, parts, G), empty(P, parts, G), empty(P, parts, G, D)
        used_parts = empty(P, parts, dtype=torch.int32)
        out = empty(B, Hq, T, D, dtype=query.dtype)
        used = empty(P, dtype=torch.int32)
        if arrivals is None:
            arrivals = torch.zeros(P, dtype=torch.int32, device=device)
        elif arrivals.shape != (P,) or arrivals.dtype != torch.int32 or arrivals.device != device:
            raise ValueError(
                f"flash: arrivals must be int32 [{P}] on {device}, got {arrivals.dtype} {list(arrivals.shape)}"
            )
        # 16-bit inputs use tensor-core dots. Triton's CPU interpreter (3.9) gets bf16 dots wrong, so there bf16 is
        # upcast first; the device benchmark checks the bf16 dots against the reference at the target shapes.
        half = triton_path.tensor_core_dots(query.dtype)
        sparse_pass[(P * parts,)](
            query,
            keys,
            values,
            index,
            log_weight,
            runs,
            key_sum,
            value_sum,
            count,
            key_square_sum,
            mean_logit,
            logit_var,
            row_max,
            den,
            acc,
            used_parts,
            arrivals,
            out,
            used,
            query.stride(0),
            query.stride(1),
            query.stride(2),
            keys.stride(0),
            keys.stride(1),
            keys.stride(2),
            values.stride(0),
            values.stride(1),
            values.stride(2),
            P,
            Hkv,
            Gs,
            T,
            ksel,
            C,
            parts,
            scale,
            G=G,
            BLOCK_G=block_g,
            BLOCK_K=block_k,
            CHUNK_C=chunk_c,
            D=D,
            BLOCK_D=block_d,
            PROXY=proxy,
            SECOND=second,
            STATS=stats is not None,
            HALF=half,
            BLOCK_PARTS=_pow2(parts, 2),
            **{
                name: value
                for name, value in (("num_warps", self.num_warps), ("num_stages", self.num_stages))
                if value is not None
            },
        )
        return out, used.view(B, Hkv, Gs, T) if proxy else None


@hookimpl
def register_kernels(register):
    if triton is not None:
        register(FlashKernel)
