"""What a patched model did, per layer and call: read density, proxies, prepare and attend time — measured without
making the host wait for the device."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class Span:
    """A stretch of a layer call: host time on the CPU; on a GPU two CUDA events, read only when asked (one wait
    then), so that timing every layer call never makes the host wait for the device."""

    def __init__(self, like: Tensor) -> None:
        self._device = like.device if like.is_cuda else None
        self._start = self._mark()
        self._end: Any = None  # as _start: a perf_counter reading on the CPU, a CUDA event on a GPU

    def stop(self) -> Span:
        self._end = self._mark()
        return self

    def __float__(self) -> float:
        if self._device is None:
            return self._end - self._start
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000

    def _mark(self):
        if self._device is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))  # the stream the layer's work goes to
        return event


@dataclass
class StepRecord:
    """One attention call of one layer. Its density, proxy count and times are read (from the device) when asked:
    recording a decode step never waits on the device."""

    layer: int
    phase: str  # "prefill" | "question" | "decode"
    position: int  # tokens already cached before the call
    tokens: int  # T
    density_total: Tensor | float  # exact rows read over the valid context (1.0 when dense), summed over the blocks
    proxies_total: Tensor | float  # proxies per (query, selection head), summed over the call's blocks
    blocks: int  # the call's causal blocks
    dense: bool
    reason: str
    prepare_span: Span | float
    attend_span: Span | float

    @property
    def density(self) -> float:
        """Exact rows read over the valid context (1.0 when dense), mean over the call's blocks."""
        return float(self.density_total) / max(self.blocks, 1)

    @property
    def proxies(self) -> float:
        """Proxies per (query, selection head), mean."""
        return float(self.proxies_total) / max(self.blocks, 1)

    @property
    def prepare_s(self) -> float:
        return float(self.prepare_span)

    @property
    def attend_s(self) -> float:
        return float(self.attend_span)


@dataclass
class GenerationStats:
    """Per layer and call: read density, proxies, time in prepare vs attend (``records``), with summaries."""

    records: list[StepRecord]

    def sparse(self) -> list[StepRecord]:
        return [r for r in self.records if not r.dense]

    @property
    def density(self) -> float:
        """Mean read density of the sparse calls (1.0 if none was sparse)."""
        sparse = self.sparse()
        return sum(r.density for r in sparse) / len(sparse) if sparse else 1.0

    def density_by_layer(self) -> dict[int, float]:
        layers: dict[int, list[float]] = {}
        for r in self.records:
            layers.setdefault(r.layer, []).append(r.density)
        return {layer: sum(d) / len(d) for layer, d in sorted(layers.items())}

    @property
    def prepare_seconds(self) -> float:
        return sum(r.prepare_s for r in self.records)

    @property
    def attend_seconds(self) -> float:
        return sum(r.attend_s for r in self.records)

    def summary(self) -> str:
        sparse = self.sparse()
        reasons = sorted({r.reason for r in self.records if r.phase != "prefill"})
        proxies = sum(r.proxies for r in sparse) / len(sparse) if sparse else 0.0
        return (
            f"{len(sparse)} sparse and {len(self.records) - len(sparse)} dense layer calls; read density "
            f"{self.density:.4f} (sparse calls), {proxies:.1f} proxies per query head; prepare "
            f"{self.prepare_seconds:.2f} s, sparse attend {self.attend_seconds:.2f} s"
            + "".join(f"; {reason}" for reason in reasons)
        )
