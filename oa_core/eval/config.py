"""What ``oa eval`` runs (``EvalConfig``) and its checks, all before any model loads: the arguments, the specs (each
file loaded, ``--sink`` / ``--local-window`` applied) and every cell's budget against its spec's sink + local."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

import oa_core as oa
from oa_core.eval import ruler
from oa_core.eval.records import ATTENTION_ERROR, METRICS


@dataclass
class EvalConfig:
    specs: list[str]  # YAML paths (names are their stems)
    densities: list[float] = field(default_factory=lambda: [0.1, 0.05, 0.03])  # 1%: see check_budgets
    tasks: list[str] = field(default_factory=lambda: list(ruler.HARD_TASKS))
    lengths: list[int] = field(default_factory=lambda: [4096])
    samples: int = 20
    seed: int = 0
    setup: Literal["A", "B"] = "B"  # checked by check_config (a caller may pass any string)
    out: Path = Path("runs/eval")
    model: str | None = None  # a transformers path or id; None: the offline SmolLM2
    sink: int | None = None  # None: each spec's own; a number overrides every sparse spec's (recorded in each
    local: int | None = None  # record's resolved_spec): at 1% of 4K the budget is 40 rows, less than 4 + 64
    max_new_tokens: int | None = None  # None: each task's RULER length
    progress: bool = True
    metric: str = "ruler"  # ruler: task scores; attention-error: ‖ô − o‖/‖o‖ on the model's own caches
    decode: int = 64  # attention-error: decode queries after each length's context
    layers: list[int] | None = None  # attention-error: None, six spread over the model
    diagnostics: bool = False  # attention-error: also E, the selector's top-32 recall and ErrorGate's Spearman
    batch: int = 1  # ruler: samples decoded together (same question length; contexts left-padded)
    device: str | None = None  # None: a given model's own device; a loaded model's: cuda if there is one, else cpu


def spec_name(path: str) -> str:
    return Path(path).stem


def is_reference(spec: oa.PipelineSpec) -> bool:
    """Whether a spec reads the whole context (``specs/dense.yaml``): the dense reference, never overridden."""
    return spec.budget.density == 1.0 and spec.budget.tokens is None


def resolved_specs(config: EvalConfig) -> dict[str, tuple[dict, bool]]:
    """name → (the spec as a mapping — its own sink and local, unless the config overrides them —, whether it is the
    dense reference)."""
    out = {}
    for path in config.specs:
        spec = oa.load_spec(path)  # a clear SpecError for a bad file, before any work
        data = spec.model_dump(mode="json", exclude_none=True)
        dense = is_reference(spec)
        if not dense:
            data.update({k: v for k, v in (("sink", config.sink), ("local", config.local)) if v is not None})
        out[spec_name(path)] = (data, dense)
    if not any(dense for _, dense in out.values()):
        out["dense"] = ({"budget": {"density": 1.0}}, True)
    return out


def check_budgets(specs: dict[str, tuple[dict, bool]], config: EvalConfig) -> None:
    """A clear error, before any model loads, for a density whose budget at some length is below the spec's sink +
    local (``PipelineSpec.too_short``, the pipeline's own rule: such a cell would run dense, with no figure for its
    method; the prompt's context is a little shorter than the length: its budget is at most this one)."""
    for name, (data, dense) in specs.items():
        spec = oa.load_spec(data)
        for density in [] if dense else config.densities:
            at = spec.model_copy(update={"budget": oa.Budget(density=density)})
            for length in config.lengths:
                if bool(at.too_short(torch.tensor([length])).any()):  # it would run dense: no figure for the method
                    raise oa.SpecError(
                        f"budget: {name} at {density:.0%} of {length} tokens reads "
                        f"{at.budget.rows(length)} rows, fewer than its sink + local = {spec.sink} + "
                        f"{spec.local}; pass a smaller --sink / --local-window (sink=, local= in "
                        "EvalConfig)"
                    )


def check_config(config: EvalConfig) -> None:
    """A ValueError naming the argument, for any that is out of range, unknown or empty."""
    if config.metric not in METRICS:
        raise ValueError(f"metric: unknown {config.metric!r}; known: {', '.join(METRICS)}")
    for task in config.tasks if config.metric == "ruler" else ():
        if task not in ruler.TASKS:
            raise ValueError(f"tasks: unknown {task!r}; known: {', '.join(ruler.TASKS)}")
    for density in config.densities:
        if not 0 < density <= 1:
            raise ValueError(f"densities: {density} is outside (0, 1]")
    if config.setup not in ("A", "B"):
        raise ValueError(f"setup: expected 'A' or 'B', got {config.setup!r}")
    for name, least in (("samples", 1), ("batch", 1), ("max_new_tokens", 1), ("decode", 1), ("sink", 0), ("local", 0)):
        value = getattr(config, name)
        if value is not None and value < least:
            raise ValueError(f"{name}: expected at least {least}, got {value}")
    if not config.lengths or any(length < 1 for length in config.lengths):
        raise ValueError(f"lengths: expected positive token counts, got {config.lengths}")
    if not config.specs or not config.densities or (config.metric == "ruler" and not config.tasks):
        empty = "specs" if not config.specs else "densities" if not config.densities else "tasks"
        raise ValueError(f"{empty}: none given")
    if config.metric == ATTENTION_ERROR:
        from oa_core.analysis.attention_error import PREFILL_QUERIES

        for length in config.lengths:
            if length < PREFILL_QUERIES:
                raise ValueError(f"lengths: attention error needs at least {PREFILL_QUERIES} tokens, got {length}")
