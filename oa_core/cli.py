"""The ``oa`` command: ``oa plugins``, ``oa validate SPEC.yaml ...``, ``oa demo``."""

from __future__ import annotations

import argparse
import sys

from oa_core.components import KINDS
from oa_core.pipeline import build
from oa_core.registry import default_registry
from oa_core.spec import SpecError


def plugins_command(args: argparse.Namespace) -> int:
    registry = default_registry()
    rows = [(info.kind, info.name, info.package, info.doc)
            for kind in KINDS for info in sorted(registry.components[kind].values(), key=lambda i: i.name)]
    widths = [max(len(row[i]) for row in rows + [("kind", "name", "package", "")]) for i in range(3)]
    print(f"{'kind':<{widths[0]}}  {'name':<{widths[1]}}  {'package':<{widths[2]}}  description")
    for row in rows:
        print(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}")
    for failure in registry.failures:
        print(f"error: {failure}", file=sys.stderr)
    return 0


def validate_command(args: argparse.Namespace) -> int:
    status = 0
    for path in args.specs:
        try:
            pipe = build(path)
        except SpecError as exc:
            print(f"{path}: invalid: {exc}")
            status = 1
        else:
            print(f"{path}: ok: {pipe!r}")
    return status


def demo_command(args: argparse.Namespace) -> int:
    from oa_core.demo import run_demo

    return run_demo(model=args.model, tokens=args.tokens, density=args.density)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oa", description="OpenAttention: sparse decode attention with tail proxies.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("plugins", help="list registered components").set_defaults(run=plugins_command)
    validate = commands.add_parser("validate", help="check pipeline spec YAML files")
    validate.add_argument("specs", nargs="+", metavar="SPEC.yaml")
    validate.set_defaults(run=validate_command)
    demo = commands.add_parser("demo", help="a needle in essays, answered by dense and by OpenAttention")
    demo.add_argument("--model", default=None, help="transformers model path or id (default: the offline SmolLM2)")
    demo.add_argument("--tokens", type=int, default=3000, help="context length in tokens")
    demo.add_argument("--density", type=float, default=0.03, help="read density")
    demo.set_defaults(run=demo_command)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
