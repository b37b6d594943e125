"""The fused static step against the reference pipeline, decoding the same tokens side by side: what the tests of
``oa_plugins.kernels.flash_step`` assert and ``benchmarks/fused_step_sweep.py`` records over random configurations.

Three decodes of one cache: the reference pipeline (``Pipeline.explain`` and ``attend`` after each ``append``), the
composed static step (``StaticState.grow`` and ``selection``, the fused step turned off) and the fused one
(``FusedStep.run``). Per step the record holds both sets of rows, both outputs, and whether the fused index and runs
are the composed step's column for column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import oa_core as oa
from oa_core.static import StaticState
from oa_core.testing.conformance import make_inputs


@dataclass
class FusedStepRecord:
    """One decode step: the rows each (batch row, KV head, selection head) read, sorted (``selected_rows``), by the
    reference pipeline and by the fused step; both outputs; ``same_layout``: the fused index and runs equal the
    composed static step's; ``weighted``: the fused selection gave a row a log weight (it must not)."""

    reference_rows: list[list[int]]
    rows: list[list[int]]
    reference_out: Tensor
    out: Tensor
    same_layout: bool
    weighted: bool


def selected_rows(index: Tensor) -> list[list[int]]:
    """``[..., K]`` row indices (-1 padding) → each row's indices, sorted."""
    return [sorted(i for i in row.tolist() if i >= 0) for row in index.reshape(-1, index.shape[-1])]


def decode_side_by_side(
    spec: dict, tokens: int = 140, steps: int = 8, room: int = 0, **inputs
) -> tuple[list[FusedStepRecord], StaticState, StaticState]:
    """Prefill ``tokens`` of ``make_inputs``' clustered cache (``_inputs``: its keywords ``dtype``, ``seed``,
    ``repeat``, ``group``, ``dim`` and ``device``), then decode ``steps`` more through the three decodes, in a static
    cache of ``room`` slots to spare → (a record per step, the composed and the fused static states at the end).
    Raises ``StaticUnsupported`` where a static state cannot serve the spec, and ``ValueError`` where the kernel has no
    fused step for it."""
    pipe = oa.build(spec)
    keys, values, prefill, mask, query_at = _inputs(tokens, steps, **inputs)
    B, H, _, D = keys.shape
    capacity = tokens + steps + room
    reference = pipe.prepare(keys[:, :, :tokens], values[:, :, :tokens], prefill, mask=mask)
    composed, fused = (
        StaticState.from_state(pipe.prepare(keys[:, :, :tokens], values[:, :, :tokens], prefill, mask=mask), capacity)
        for _ in range(2)
    )
    if fused.fused is None:
        raise ValueError(f"no fused step: kernel {pipe.kernel.name!r} composes this spec's step (Kernel.static_step)")
    composed.fused = None
    cache_k, cache_v = keys.new_zeros(B, H, capacity, D), values.new_zeros(B, H, capacity, D)
    cache_k[:, :, :tokens], cache_v[:, :, :tokens] = keys[:, :, :tokens], values[:, :, :tokens]
    records = []
    for n in range(tokens, tokens + steps):
        reference.append(keys[:, :, n : n + 1], values[:, :, n : n + 1])
        cache_k[:, :, n], cache_v[:, :, n] = keys[:, :, n], values[:, :, n]
        composed.length += 1
        fused.length += 1
        query = query_at(n)
        composed.grow(cache_k, cache_v)
        out, selection = fused.fused.run(fused, query, cache_k, cache_v)
        layout = composed.selection(query, cache_k)
        records.append(
            FusedStepRecord(
                reference_rows=selected_rows(pipe.explain(query, reference).selection.index),
                rows=selected_rows(selection.index),
                reference_out=pipe.attend(query, reference),
                out=out,
                same_layout=torch.equal(selection.index, layout.index) and _same(selection.runs, layout.runs),
                weighted=bool(selection.log_weight.any()),
            )
        )
    return records, composed, fused


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def reference_rows(spec: dict, tokens: int = 140, steps: int = 8, **inputs) -> list[list[list[int]]]:
    """The reference pipeline alone on ``decode_side_by_side``'s inputs and queries (``_inputs``' keywords) → its rows
    per step."""
    pipe = oa.build(spec)
    keys, values, prefill, mask, query_at = _inputs(tokens, steps, **inputs)
    reference = pipe.prepare(keys[:, :, :tokens], values[:, :, :tokens], prefill, mask=mask)
    rows = []
    for n in range(tokens, tokens + steps):
        reference.append(keys[:, :, n : n + 1], values[:, :, n : n + 1])
        rows.append(selected_rows(pipe.explain(query_at(n), reference).selection.index))
    return rows


def _inputs(
    tokens: int,
    steps: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    repeat: slice | None = None,
    group: int = 3,
    dim: int = 32,
    device: str | torch.device = "cpu",
) -> tuple:
    """``tokens + steps`` positions of ``make_inputs``' cache (2 batch rows, the second left-padded by 25; 2 KV heads of
    ``group`` query heads and ``dim`` dimensions; ``repeat``: those keys repeated right after them, ties in the scores
    and logits), its prefill queries and padding mask on ``device``, and the decode query at position n (its KV head's
    key there × 1.1 plus noise, drawn on the CPU from a generator seeded ``seed + 1``, one draw per call in order)."""
    keys, values, prefill, _ = make_inputs(tokens=tokens + steps, seed=seed, dtype=dtype, group=group, dim=dim)
    if repeat is not None:
        keys[:, :, repeat.stop : 2 * repeat.stop - repeat.start] = keys[:, :, repeat]
    B, H, _, D = keys.shape
    Hq = prefill.shape[1]
    mask = torch.ones(B, tokens, dtype=torch.bool)
    mask[1, :25] = False
    gen = torch.Generator().manual_seed(seed + 1)

    def query_at(n: int) -> Tensor:
        query = keys[:, torch.arange(Hq) // (Hq // H), n : n + 1].float() * 1.1
        return (query + 0.3 * torch.randn(B, Hq, 1, D, generator=gen)).to(device=device, dtype=dtype)

    return *(t.to(device) for t in (keys, values, prefill, mask)), query_at
