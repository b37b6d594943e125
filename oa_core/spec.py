"""The pipeline spec: a pydantic model that YAML files, dicts and instances all become.

A component is a name or a mapping ``{name: ..., <params>}``; its params are validated by the component's own
``Config`` when the pipeline is built (``oa_core.pipeline.build``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, overload

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class SpecError(ValueError):
    """An invalid spec or input; the message names the offending field."""


def describe(error: ValidationError, prefix: str = "") -> str:
    """One line per pydantic error: ``field.path: message``."""
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"] if part != "params")
        field = ".".join(part for part in (prefix, loc) if part)
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {message}" if field else message)  # a whole-spec rule names its fields itself
    return "; ".join(lines)


class ComponentSpec(BaseModel):
    """A component by registered name, with the parameters its own Config validates."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="a registered component of the kind (`oa plugins` lists them)")
    params: dict[str, Any] = Field(
        default_factory=dict, description="its Config's fields; unnamed ones take their defaults"
    )

    @model_validator(mode="before")
    @classmethod
    def _name_or_mapping(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"name": value}
        if isinstance(value, Mapping) and "params" not in value:
            params = dict(value)
            return {"name": params.pop("name", None), "params": params}
        return value


class Budget(BaseModel):
    """Exact rows read per query and KV row set, sink and local included: a density of the context or a count."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    density: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="rows read exactly, as a share of the context (rounded down); give this or tokens",
    )
    tokens: int | None = Field(default=None, gt=0, description="rows read exactly, as a count; give this or density")

    @model_validator(mode="after")
    def _exactly_one(self) -> Budget:
        if (self.density is None) == (self.tokens is None):
            raise ValueError("give exactly one of density or tokens")
        return self

    @overload
    def rows(self, num_tokens: int) -> int: ...

    @overload
    def rows(self, num_tokens: torch.Tensor) -> torch.Tensor: ...

    def rows(self, num_tokens: int | torch.Tensor) -> int | torch.Tensor:
        """The budget E in rows for a context of ``num_tokens`` (an int, or a long tensor of per-row lengths);
        rounded down, so the measured density stays within."""
        if isinstance(num_tokens, torch.Tensor):
            if self.tokens is not None:
                return torch.full_like(num_tokens, self.tokens)
            assert self.density is not None  # exactly one of the two (_exactly_one)
            return torch.floor(num_tokens.double() * self.density).long()
        if self.tokens is not None:
            return self.tokens
        assert self.density is not None
        return math.floor(self.density * num_tokens)


class PipelineSpec(BaseModel):
    """A whole OpenAttention pipeline (docs/design.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clusterer: ComponentSpec = Field(
        default=ComponentSpec(name="qgc"),
        description="groups the keys the selector may pass over; each cluster's unread tail gets one proxy",
    )
    selector: ComponentSpec = Field(
        default=ComponentSpec(name="pq"),
        description="scores every clusterable row against the query; the best-scored are read exactly",
    )
    allocator: ComponentSpec = Field(
        default=ComponentSpec(name="errorgate"), description="splits the budget into per-cluster quotas of exact rows"
    )
    kernel: ComponentSpec = Field(
        default=ComponentSpec(name="auto"),
        description="computes attention over the "
        "exact rows and the tail; auto: the registered kernel of highest priority that "
        "runs on this device",
    )
    tail: Literal["proxy", "discard", "sample"] = Field(
        default="proxy",
        description="what stands for the rows not read: one proxy per cluster, nothing (top-k "
        "attention), or weighted uniform samples",
    )
    proxy: Literal["second-order", "mean"] = Field(
        default="second-order",
        description="tail=proxy: each cluster's tail as e^{s·q·k̄_T}·n_T (mean, the "
        "paper's) or times 1 + σ̂_T²/2, the tail's logit variance (second-order)",
    )
    tail_samples: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="tail=sample: share of the selectable "
        "budget spent on uniform tail samples (1: sampling only, no selector)",
    )
    budget: Budget = Field(
        default=Budget(density=0.03),
        description="exact rows per query and KV head, sink and local included: {density: d} or {tokens: n}",
    )
    sink: int = Field(default=4, ge=0, description="the first rows of the context, always read exactly")
    local: int = Field(default=64, ge=0, description="the newest rows, always read exactly")
    gqa: Literal["per_head", "shared"] = Field(
        default="per_head", description="select per query head, or once per KV head for the whole GQA group"
    )
    seed: int = Field(
        default=0,
        description="seeds the clusterer's and the selector's random draws (on the CPU: "
        "the same clusters on every device)",
    )

    @model_validator(mode="after")
    def _tokens_cover_sink_and_local(self) -> PipelineSpec:
        if self.budget.tokens is not None and self.budget.tokens < self.sink + self.local:
            raise ValueError(
                f"budget.tokens: {self.budget.tokens} rows is smaller than sink + local = {self.sink} + "
                f"{self.local} = {self.sink + self.local} (the budget includes them); raise budget.tokens "
                "or lower sink / local"
            )
        return self

    def read_in_full(self, lengths: torch.Tensor) -> torch.Tensor:
        """``[B]`` valid context lengths → the rows this spec reads in full: its budget covers the context, the
        context is no longer than sink + local, or a density's budget on a short context cannot cover sink + local
        (``too_short``; ``why_read_in_full`` says which). A budget of tokens covers sink + local (validated)."""
        budget = self.budget.rows(lengths)
        return (budget >= lengths) | (lengths <= self.sink + self.local) | self.too_short(lengths)

    def too_short(self, lengths: torch.Tensor) -> torch.Tensor:
        """``[B]`` lengths → the rows whose budget is below sink + local although the context is longer than both."""
        budget = self.budget.rows(lengths)
        fixed = self.sink + self.local
        return (budget < fixed) & (budget < lengths) & (lengths > fixed)

    def why_read_in_full(self, lengths: torch.Tensor) -> str:
        """Why ``read_in_full``'s rows are read in full, in words: a short context's budget (the first such row's
        numbers), or a budget that covers the context."""
        short = self.too_short(lengths)
        if not bool(short.any()):
            return BUDGET_COVERS
        row = int(short.nonzero()[0, 0])
        return (
            f"budget of {int(self.budget.rows(lengths)[row])} rows ({self.budget.density:.1%} of "
            f"{int(lengths[row])} tokens) < sink + local = {self.sink + self.local}"
        )


BUDGET_COVERS = "budget >= context"  # ``why_read_in_full`` where no row is a short context


def load_spec(spec: PipelineSpec | Mapping | str | Path) -> PipelineSpec:
    """A spec model from a model, a mapping or a YAML file path (read with ``yaml.safe_load``)."""
    if isinstance(spec, PipelineSpec):
        return spec
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        if not path.is_file():
            raise SpecError(f"spec file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
            raise SpecError(f"{where}: invalid YAML: {getattr(exc, 'problem', None) or exc}") from None
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise SpecError(f"{path}: a spec is a YAML mapping, got {type(data).__name__}")
        spec = data
    if not isinstance(spec, Mapping):
        raise SpecError(f"a spec is a PipelineSpec, a mapping or a YAML path, got {type(spec).__name__}")
    try:
        return PipelineSpec.model_validate(dict(spec))
    except ValidationError as exc:
        raise SpecError(describe(exc)) from None
