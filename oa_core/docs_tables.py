"""The generated blocks of ``docs/components.md``: every built-in component's parameters and the spec's own fields,
read from their pydantic models through the registry, and the ready specs of ``specs/``, read with ``load_spec``.

    python -m oa_core.docs_tables            # print the blocks
    python -m oa_core.docs_tables --write    # rewrite them in docs/components.md
    python -m oa_core.docs_tables --check    # exit 1 when docs/components.md differs (tests/test_docs.py does too)

A block sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; everything outside the markers is the page's
own text. Only the components of this distribution are listed: an installed third-party plugin documents itself.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from oa_core.components import KINDS
from oa_core.registry import BUILT_IN, default_registry
from oa_core.spec import Budget, ComponentSpec, PipelineSpec, load_spec

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "components.md"
SPECS = ROOT / "specs"
COMMAND = "python -m oa_core.docs_tables --write"

BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.MultipleOf, "multiple_of", "multiple of"),
    (annotated_types.MinLen, "min_length", "length ≥"),
    (annotated_types.MaxLen, "max_length", "length ≤"),
)


def _cell(text: str) -> str:
    """Text fit for one markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value: Any) -> str:
    return f"`{value}`"


def _flow(value: Any) -> str:
    """A value as a spec writes it in YAML's flow style: ``qgc``, ``{density: 0.03}``, ``true``."""
    if isinstance(value, ComponentSpec):
        return value.name if not value.params else _flow({"name": value.name, **value.params})
    if isinstance(value, BaseModel):
        return _flow(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_flow(item)}" for key, item in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a union (``int | None`` → [int, None]), or the annotation alone."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [None if arg is type(None) else arg for arg in typing.get_args(annotation)]
    return [annotation]


def _type_name(annotation: Any) -> str:
    if annotation is None:
        return "null"
    if typing.get_origin(annotation) is Literal:
        kinds = {type(arg) for arg in typing.get_args(annotation)}
        return kinds.pop().__name__ if len(kinds) == 1 else "literal"
    if annotation is ComponentSpec:
        return "component"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def field_type(field: FieldInfo) -> str:
    """``int``, ``int`` or ``null``, ``str`` (a Literal's values go to the constraint)."""
    return " or ".join(_code(_type_name(member)) for member in _members(field.annotation))


def field_default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:  # the components' factories take no arguments
        return _code(_flow(cast(Callable[[], Any], field.default_factory)()))
    return _code(_flow(field.default))


def field_constraint(field: FieldInfo) -> str:
    """The field's bounds (``≥ 1``, ``≤ 62``) and a Literal's values (``one of `4`, `8```)."""
    parts = []
    for member in _members(field.annotation):
        if typing.get_origin(member) is Literal:
            parts.append("one of " + ", ".join(_code(_flow(arg)) for arg in typing.get_args(member)))
    for item in field.metadata:
        for kind, attribute, symbol in BOUNDS:
            if isinstance(item, kind):
                parts.append(f"{symbol} {getattr(item, attribute)}")
    return ", ".join(parts)


def cross_field_rules(model: type[BaseModel]) -> list[str]:
    """The model's ``mode="after"`` validators (rules over several fields), by their docstring's first line."""
    rules = []
    for decorator in model.__pydantic_decorators__.model_validators.values():
        if decorator.info.mode != "after":
            continue
        doc = (decorator.func.__doc__ or "").strip()
        rules.append(doc.splitlines()[0] if doc else "")
    return rules


def parameter_table(model: type[BaseModel]) -> str:
    """A markdown table of ``model``'s fields: name, type, default, constraint, description."""
    if not model.model_fields:
        return "No parameters."
    lines = ["| parameter | type | default | constraint | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        cells = (_code(name), field_type(field), field_default(field), field_constraint(field), field.description or "")
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    rules = cross_field_rules(model)
    if rules:
        said = "; ".join(rule for rule in rules if rule)
        lines += [
            "",
            f"`{model.__name__}` also checks a rule across its fields when the spec is built"
            + (f": {said}." if said else " (the error says which)."),
        ]
    return "\n".join(lines)


def _kernel_note(cls: type) -> str:
    proxies = ", ".join(_code(name) for name in getattr(cls, "proxies", ()))
    priority = getattr(cls, "priority", 0)
    return f" Proxies it computes: {proxies}; `priority` {priority} (`kernel: auto` takes the highest)."


def render_params() -> str:
    """The spec's own fields, then every built-in component's parameters, kind by kind."""
    registry = default_registry()
    intro = (
        f"`{PipelineSpec.__module__}.{PipelineSpec.__name__}`; a component field takes a name or "
        "`{name: ..., <parameters>}` (the tables below)."
    )
    parts = [
        "### The spec's own fields",
        "",
        intro,
        "",
        parameter_table(PipelineSpec),
        "",
        f"`budget` (`{Budget.__module__}.{Budget.__name__}`):",
        "",
        parameter_table(Budget),
    ]
    found = False
    for kind in KINDS:
        infos = [
            info
            for info in (registry.get(kind, name) for name in registry.names(kind))
            if info is not None and info.package == BUILT_IN
        ]
        if not infos:
            continue
        parts += ["", f"### {kind.capitalize()}s"]
        for info in infos:
            found = True
            cls, config = info.cls, info.cls.Config
            note = _kernel_note(cls) if kind == "kernel" else ""
            where = f"`{cls.__module__}.{cls.__name__}`"
            params = f", parameters `{config.__name__}`:" if config.model_fields else "; no parameters."
            parts += ["", f"#### `{info.name}`", "", f"{info.doc} {where}{params}{note}"]
            if config.model_fields:
                parts += ["", parameter_table(config)]
    if not found:
        raise RuntimeError(
            f"no component of {BUILT_IN!r} is registered: install this checkout "
            "(pip install -e .) so that its entry points register the built-in components"
        )
    return "\n".join(parts)


def render_specs(folder: Path = SPECS) -> str:
    """One row per file of ``specs/``: the pipeline it builds, as ``load_spec`` resolves it."""
    lines = [
        "| file | clusterer | selector | allocator | tail | budget | sink, local | gqa |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(folder.glob("*.yaml")):
        spec = load_spec(path)
        tail = (
            f"{spec.tail}, {spec.proxy}"
            if spec.tail == "proxy"
            else (f"sample, {spec.tail_samples}" if spec.tail == "sample" else spec.tail)
        )
        cells = (
            _code(path.name),
            _code(_flow(spec.clusterer)),
            _code(_flow(spec.selector)),
            _code(_flow(spec.allocator)),
            tail,
            _code(_flow(spec.budget)),
            f"{spec.sink}, {spec.local}",
            spec.gqa,
        )
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines)


BLOCKS: dict[str, Callable[[], str]] = {"specs": render_specs, "params": render_params}


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the lines between ``<!-- name:begin -->`` and ``<!-- name:end -->`` replaced by ``body``."""
    pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.DOTALL)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"expected one <!-- {name}:begin --> ... <!-- {name}:end --> block")
    return pattern.sub(lambda match: match.group(1) + body.rstrip("\n") + "\n" + match.group(2), text)


def rendered(text: str) -> str:
    """The page's text with every generated block rewritten."""
    for name, render in BLOCKS.items():
        text = replace_block(text, name, render())
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oa_core.docs_tables", description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"rewrite the blocks in {PAGE.name}")
    action.add_argument("--check", action="store_true", help=f"exit 1 when {PAGE.name}'s blocks are stale")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page holding the blocks")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        print("\n\n".join(f"<!-- {name} -->\n{render()}" for name, render in BLOCKS.items()))
        return 0
    text = args.page.read_text()
    new = rendered(text)
    if args.check:
        if new != text:
            print(f"{args.page}: generated blocks are stale; run: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.page.write_text(new)
    print(f"{args.page}: {'rewritten' if new != text else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
