"""The ``oa`` command: ``oa plugins``, ``oa validate SPEC.yaml ...``, ``oa demo``, ``oa eval``, ``oa report``."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from oa_core.analysis.offline_model import MODEL_HELP
from oa_core.components import KINDS
from oa_core.pipeline import build
from oa_core.registry import default_registry
from oa_core.spec import SpecError


def plugins_command(args: argparse.Namespace) -> int:
    registry = default_registry()
    rows = [
        (info.kind, info.name, info.package, info.doc)
        for kind in KINDS
        for info in sorted(registry.components[kind].values(), key=lambda i: i.name)
    ]
    widths = [max(len(row[i]) for row in [*rows, ("kind", "name", "package", "")]) for i in range(3)]
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
    from oa_core.analysis.demo import run_demo

    try:
        return run_demo(model=args.model, tokens=args.tokens, density=args.density, out=args.out)
    except ValueError as exc:  # SpecError included: checked before the model loads
        print(f"oa demo: {exc}", file=sys.stderr)
        return 2


def default_specs() -> list[str]:
    """Every baseline spec under ./specs (the ablations left out): what ``oa eval`` compares by default."""
    from pathlib import Path

    return sorted(str(p) for p in Path("specs").glob("*.yaml") if not p.name.startswith("ablate-"))


def eval_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from oa_core.eval import runner
    from oa_core.eval.records import summary_table

    specs = args.specs or default_specs()
    if not specs:
        print("oa eval: no spec given and no specs/*.yaml here; pass --specs", file=sys.stderr)
        return 2
    config = runner.EvalConfig(
        specs=specs,
        densities=args.densities,
        tasks=args.tasks,
        lengths=args.length,
        samples=args.samples,
        seed=args.seed,
        setup=args.setup,
        out=Path(args.out),
        model=args.model,
        sink=args.sink,
        local=args.local,
        max_new_tokens=args.max_new_tokens,
        metric=args.metric,
        decode=args.decode,
        layers=args.layers,
        diagnostics=args.diagnostics,
        batch=args.batch,
        device=args.device,
    )
    try:
        _say_overrides(specs, sink=args.sink, local=args.local)
        rows = runner.run(config)
    except (SpecError, ValueError, ModuleNotFoundError) as exc:
        print(f"oa eval: {exc}", file=sys.stderr)
        return 2
    except runner.IncompleteRun as exc:
        print(f"oa eval: {exc}", file=sys.stderr)
        return 1
    if rows is not None:
        print(summary_table(rows))
        print(f"records and summary in {args.out}")
    return 0


def _say_overrides(specs: list[str], **values: int | None) -> None:
    """One line per field --sink / --local-window set for every sparse spec, with the specs' own values."""
    from oa_core.eval.config import is_reference, spec_name
    from oa_core.spec import load_spec

    loaded = {spec_name(path): load_spec(path) for path in specs}
    sparse = {name: spec for name, spec in loaded.items() if not is_reference(spec)}
    for field, value in values.items():
        if value is not None and sparse:
            own = ", ".join(f"{name}: {getattr(spec, field)}" for name, spec in sparse.items())
            label = "local window" if field == "local" else field
            print(f"oa eval: {label} {value} for every sparse spec ({own})", file=sys.stderr)


def report_command(args: argparse.Namespace) -> int:
    from oa_core.eval.report import build_report

    try:
        path = build_report(args.dir, dense_floor=args.dense_floor, generator=args.generator)
    except (FileNotFoundError, ValueError) as exc:
        print(f"oa report: {exc}", file=sys.stderr)
        return 2
    print(path.read_text(encoding="utf-8"))
    print(f"wrote {path} and its plots")
    return 0


class _WithDefaults(argparse.HelpFormatter):
    """Help that ends with each option's default, where it has one and its text does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default in (None, argparse.SUPPRESS)
            or action.default is False
            or "default" in text
        ):
            return text
        value = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
        return f"{text} (default: {value})"


def build_parser() -> argparse.ArgumentParser:
    """The ``oa`` command line: its subcommands, their options and defaults."""
    parser = argparse.ArgumentParser(prog="oa", description="OpenAttention: sparse decode attention with tail proxies.")
    commands = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(commands.add_parser, formatter_class=_WithDefaults)
    command("plugins", help="list registered components").set_defaults(run=plugins_command)
    validate = command("validate", help="check pipeline spec YAML files")
    validate.add_argument("specs", nargs="+", metavar="SPEC.yaml")
    validate.set_defaults(run=validate_command)
    demo = command("demo", help="a needle in essays, answered by dense and by OpenAttention")
    demo.add_argument("--model", default=None, help=MODEL_HELP)
    demo.add_argument("--tokens", type=int, default=3000, help="context length in tokens")
    demo.add_argument("--density", type=float, default=0.03, help="read density")
    demo.add_argument("--out", type=Path, default=None, help="also write the output and the records there as JSON")
    demo.set_defaults(run=demo_command)
    from oa_core.eval.records import METRICS
    from oa_core.eval.ruler import HARD_TASKS

    evaluate = command("eval", help="RULER tasks × specs × densities on a model (resumable; torchrun)")
    evaluate.add_argument("--model", default=None, help=MODEL_HELP)
    evaluate.add_argument(
        "--specs",
        nargs="+",
        default=None,
        metavar="SPEC.yaml",
        help="pipeline specs (default: every baseline spec in ./specs)",
    )
    evaluate.add_argument(
        "--densities",
        nargs="+",
        type=float,
        default=[0.1, 0.05, 0.03],
        help="read densities; below sink + local rows a cell is refused before the model loads "
        "(1%% of 4096 tokens is 40 rows, fewer than the specs' 4 + 64: pass --local-window "
        "16 or a longer --length)",
    )
    evaluate.add_argument(
        "--tasks", nargs="+", default=list(HARD_TASKS), help="RULER tasks (default: the HARD-like set)"
    )
    evaluate.add_argument("--length", nargs="+", type=int, default=[4096], help="prompt lengths in tokens")
    evaluate.add_argument("--samples", type=int, default=20, help="samples per task and length")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of the RULER samples")
    evaluate.add_argument("--setup", choices=["A", "B"], default="B", help="B: question decoded sparsely; A: dense")
    evaluate.add_argument(
        "--sink", type=int, default=None, help="sink rows for every sparse spec (default: each spec's own)"
    )
    evaluate.add_argument(
        "--local-window",
        dest="local",
        type=int,
        default=None,
        help="local window for every sparse spec (default: each spec's own; not --local: torchrun "
        "takes that for one of its own options)",
    )
    evaluate.add_argument("--max-new-tokens", type=int, default=None, help="default: each task's RULER length")
    evaluate.add_argument("--out", default="runs/eval", help="results folder (a rerun resumes it)")
    evaluate.add_argument(
        "--batch",
        type=int,
        default=1,
        help="samples decoded together (same question length, contexts left-padded); e.g. 4 on a GPU",
    )
    evaluate.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, cuda:1 ... (default: cuda if there is one; torchrun: each rank's local GPU)",
    )
    evaluate.add_argument(
        "--metric",
        choices=list(METRICS),
        default="ruler",
        help="ruler: task scores; attention-error: relative output error on the model's caches",
    )
    evaluate.add_argument("--decode", type=int, default=64, help="attention-error: decode queries per length")
    evaluate.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=None,
        help="attention-error: layers (default: six spread over the model)",
    )
    evaluate.add_argument(
        "--diagnostics",
        action="store_true",
        help="attention-error: also E, the selector's top-32 recall and ErrorGate's Spearman",
    )
    evaluate.set_defaults(run=eval_command)
    report = command("report", help="Markdown table and plots of an `oa eval` folder")
    report.add_argument("dir", help="the folder `oa eval --out` wrote")
    report.add_argument(
        "--dense-floor",
        type=float,
        default=20.0,
        help="tasks dense scores below this are reported apart (they cannot measure retention)",
    )
    report.add_argument(
        "--generator",
        default=None,
        help="the RULER generator whose records to report, where the folder holds several's",
    )
    report.set_defaults(run=report_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # `oa report DIR | head`: the reader left; what is left to print goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a command killed by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
