"""The headline results tables of README.md and docs/results.md, rendered from the JSON in benchmarks/results.

    python benchmarks/results_tables.py            # print the tables
    python benchmarks/results_tables.py --write    # rewrite the marked blocks in README.md and docs/results.md,
                                                   # and draw benchmarks/results/headline_accuracy.png
    python benchmarks/results_tables.py --check    # exit 1 when a committed block differs (tests/test_readme.py)

A block sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``. Its figures come from the files below,
never typed by hand. A method is found in a result by what it ran, not by its name: the records' and the results'
resolved specs are compared with ``specs/openattention.yaml`` (the default), ``specs/ablate-selector-qgs.yaml`` (QGS,
the default's selector until issue 54) and ``specs/oracle-topk.yaml`` (exact top-k), budget, sink and local window
aside (each benchmark sets its own). A result measured before a spec got its present name still counts as that spec.

Each figure says what made it (``made_by``): the machine the result names (its ``provenance``, or the device fields
it had before that: a ``machine`` or ``device`` field, the records' ``device``), and the commit — the one it records,
else the last commit git has of the file ("committed in": the code that made it is that commit or an older one).
``--check`` leaves the git-derived commits out of the comparison: a result committed together with its re-rendered
tables cannot name the commit that adds it, so its label says "uncommitted" until the next ``--write``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from oa_core.analysis.provenance import git

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
COLUMNS = {
    "default": "specs/openattention.yaml",
    "QGS": "specs/ablate-selector-qgs.yaml",
    "exact top-k": "specs/oracle-topk.yaml",
}
DENSITIES = (0.03, 0.01)
# (model, folder of `oa eval` records): RULER, mean retention over the tasks dense can do.
RULER = [
    ("SmolLM2-135M", "ruler_c3f5e3b_smollm2_4k"),
    ("SmolLM2-135M", "ruler_c3f5e3b_smollm2_8k"),
    ("Gemma-3-270M", "ruler_c3f5e3b_gemma3_270m_8k"),
]
NEEDLES = [("SmolLM2-135M", "retrieval_smollm2-135m.json"), ("Gemma-3-270M", "retrieval_gemma3-270m.json")]
ATTENTION_ERROR = [
    ("SmolLM2-135M", f"attention_error{suffix}.json", text)
    for suffix, text in (("", "essays"), ("_python_docs", "Python's docs"), ("_python_source", "Python's source"))
]
SPEED = "generate_speed.json"
# generate_speed.json records the spec it ran as overrides of the code's defaults; when it ran, the default selector
# was QGS (PQS became the default with issue 54, and its one-program decode step is issue 56's).
SPEED_SELECTOR = "QGS's selection, the default before PQS"
DEMO = "demo.json"
# The other headline results (figures the tables do not render), listed with their provenance on docs/results.md.
OTHERS = [
    "ruler_c3f5e3b_smollm2_4k_cuda_check.json",
    "ablations.json",
    "kernel_h200.json",
    "cuda_consistency.json",
    "cuda_consistency_static.json",
    "mutations.json",
]
PLOT = "headline_accuracy.png"  # written by --write beside the tables (not checked: a PNG's bytes vary)
TARGETS = {"README.md": ["demo", "accuracy", "speed"], "docs/results.md": ["accuracy", "speed", "provenance"]}
# What --check does not compare: the commits git gives (see the module's docstring).
GIT_LABEL = re.compile(r"committed in [0-9a-f]{4,40}|uncommitted \(HEAD [0-9a-f]{4,40}\)|commit unknown")


@cache
def _identity(spec_json: str) -> str:
    """What a spec runs, budget, sink, local window and seed aside: its components with their full configs, its
    tail and GQA mode (a canonical JSON string)."""
    import oa_core as oa

    spec = json.loads(spec_json)
    for name in ("budget", "sink", "local", "seed", "kernel"):
        spec.pop(name, None)
    pipe = oa.build(spec)
    parts = {
        kind: [getattr(pipe, kind).name, getattr(pipe, kind).config.model_dump(mode="json")]
        for kind in ("clusterer", "selector", "allocator")
    }
    s = pipe.spec
    parts.update(
        tail=s.tail,
        proxy=s.proxy if s.tail == "proxy" else None,
        tail_samples=s.tail_samples if s.tail == "sample" else None,
        gqa=s.gqa,
    )
    return json.dumps(parts, sort_keys=True)


def identity(spec: dict) -> str:
    return _identity(json.dumps(spec, sort_keys=True))


@cache
def column_identities() -> dict[str, str]:
    import yaml

    return {column: identity(yaml.safe_load((ROOT / path).read_text())) for column, path in COLUMNS.items()}


def column_of(spec: dict) -> str | None:
    """Which table column a resolved spec is: the default, QGS, exact top-k, or None."""
    found = identity(spec)
    return next((column for column, known in column_identities().items() if known == found), None)


@dataclass(frozen=True)
class MadeBy:
    """What made a result: ``machine`` and ``commit`` as the tables print them, and how each was found."""

    machine: str
    commit: str
    how: str

    def short(self) -> str:
        return f"{self.machine}; {self.commit}"


def git_label(path: Path) -> str:
    """ "committed in <hash>" (the file's last commit), "uncommitted (HEAD <hash>)" while it differs from what git
    has, or "commit unknown" without git or a repository."""
    relative = str(path.relative_to(ROOT))
    head = git("rev-parse", "--short", "HEAD", root=ROOT)
    if head is None:
        return "commit unknown"
    if git("status", "--porcelain", "--", relative, root=ROOT):
        return f"uncommitted (HEAD {head})"
    last = git("log", "-1", "--format=%h", "--", relative, root=ROOT)
    return f"committed in {last}" if last else f"uncommitted (HEAD {head})"


def recorded_commit(provenance: dict) -> str:
    return f"commit {provenance['commit'][:7]}" + (" with uncommitted changes" if provenance.get("dirty") else "")


def _json_machine(result: dict) -> tuple[str, str]:
    """(machine, the field it was read from) for a JSON result without provenance: a GPU's name where the file has
    one (``machine.gpu``, ``machine.device``, ``device``), else the CPU (with ``machine.cpus``' count)."""
    machine = result.get("machine") if isinstance(result.get("machine"), dict) else {}
    for name, value in (
        ("machine.gpu", machine.get("gpu")),
        ("machine.device", machine.get("device")),
        ("device", result.get("device")),
    ):
        if isinstance(value, str) and value.startswith("cuda"):
            return "a CUDA GPU", f"`{name}`: {value}"
        if isinstance(value, str) and value not in ("cpu", "x86_64", "aarch64", "arm64", ""):
            return value, f"`{name}`"
    if not machine:
        return "not recorded", "no machine or device field"
    cores = machine.get("cpus")
    return "CPU" + (f" ({cores} cores)" if cores else ""), "`machine`"


def _records_made_by(folder: Path, keep=None) -> MadeBy:
    """An ``oa eval`` folder's records (those ``keep`` takes, default all): each one's machine (its provenance, else
    its ``device``: a GPU is named by its records file where the file's name does, ``records-h100.jsonl``) and the
    commits the records name, else git's."""
    machines: dict[str, int] = {}
    commits: dict[str, int] = {}
    unrecorded = 0
    for path in sorted(folder.glob("records*.jsonl")):
        named = re.fullmatch(r"records-(?!rank\d+$)(\w+)", path.stem)
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if keep is not None and not keep(record):
                continue
            provenance = record.get("provenance") or {}
            if provenance.get("machine"):
                machine = provenance["machine"]
            elif str(record.get("device", "cpu")).startswith("cuda"):
                machine = named[1].upper() if named else "a CUDA GPU"
            else:
                machine = "CPU"
            machines[machine] = machines.get(machine, 0) + 1
            if provenance.get("commit"):
                label = recorded_commit(provenance)
                commits[label] = commits.get(label, 0) + 1
            else:
                unrecorded += 1
    labels = list(commits) + ([git_label(folder)] if unrecorded or not commits else [])
    how = (
        "records: "
        + ", ".join(f"{name} {count:,}" for name, count in machines.items())
        + " (machine: `provenance`, else `device` and the records file's name); commit: "
        + ", ".join(
            [f"{count:,} records name {label.removeprefix('commit ')}" for label, count in commits.items()]
            + ([f"git ({unrecorded:,} records name none)"] if unrecorded else [])
        )
    )
    return MadeBy(" + ".join(machines) or "none", ", ".join(labels), how)


def made_by(path: Path, keep=None) -> MadeBy:
    """The machine and the commit that made a result file or an ``oa eval`` folder (of a folder, the records ``keep``
    takes; the module's docstring)."""
    if path.is_dir():
        return _records_made_by(path, keep)
    result = json.loads(path.read_text(encoding="utf-8"))
    provenance = result.get("provenance") or {}
    if provenance.get("machine"):
        machine, machine_how = provenance["machine"], "`provenance.machine`"
    else:
        machine, machine_how = _json_machine(result)
    if provenance.get("commit"):
        commit, commit_how = recorded_commit(provenance), "`provenance.commit`"
    elif isinstance(result.get("commit"), str):
        commit, commit_how = f"commit {result['commit'][:7]}", "`commit`"
    else:
        commit, commit_how = git_label(path), "git"
    return MadeBy(machine, commit, f"machine: {machine_how}; commit: {commit_how}")


@dataclass
class Row:
    """One line of the accuracy table: a benchmark on a model, each column's figure at each density."""

    model: str
    benchmark: str
    dense: str
    values: dict  # (column, density) → the figure
    source: str
    spec: str  # the figures' format
    made: MadeBy  # what made the figures
    notes: dict = field(default_factory=dict)  # (column, density) → a caveat beside the figure
    scale: float | None = None  # the figure over this is the share of dense's (the plot's y); None: not plotted

    def cells(self) -> list[str]:
        return [
            self.model,
            self.benchmark,
            self.dense,
            *(self.pair(column) for column in COLUMNS),
            self.source,
            self.made.short(),
        ]

    def pair(self, column: str) -> str:
        """'a / b': the column's figure at 3% and at 1%, each with its caveat."""
        keys = [(column, density) for density in DENSITIES]
        if all(key not in self.values for key in keys):
            return "—"
        return " / ".join(
            "—"
            if key not in self.values
            else format(self.values[key], self.spec) + (f" ({self.notes[key]})" if key in self.notes else "")
            for key in keys
        )


def ruler_rows() -> list[Row]:
    from oa_core.eval.records import read_records, summarize
    from oa_core.eval.report import DENSE_FLOOR, means_over_tasks

    rows = []
    for model, folder in RULER:
        records = read_records(RESULTS / folder)
        columns = {}
        for r in records:
            if r["density"] is not None and r["spec"] not in columns:
                columns[r["spec"]] = column_of(r["resolved_spec"])
        summary = [r for r in summarize(records) if r["metric"] == "ruler"]
        dense = {(r["task"], r["length"]): r["score"] for r in summary if r["spec"] == "dense"}
        usable = [r for r in summary if dense.get((r["task"], r["length"]), 0.0) >= DENSE_FLOOR]
        wanted = sum(r["samples"] for r in usable if r["spec"] == "dense")  # a complete cell has dense's samples

        def used(record: dict, columns: dict = columns) -> bool:  # the records the row's figures rest on
            return record["spec"] == "dense" or (
                columns.get(record["spec"]) is not None and record["density"] in DENSITIES
            )

        row = Row(model, "", "1", {}, f"`{folder}/`", ".2f", made_by(RESULTS / folder, used), scale=1.0)
        counted: dict = {}  # (column, density) → the samples its figure rests on
        for m in means_over_tasks(usable):
            key = (columns.get(m["spec"]), m["density"])
            if m["spec"] == "dense" or key[0] is None:
                continue
            have = sum(r["samples"] for r in usable if (r["spec"], r["density"]) == (m["spec"], m["density"]))
            if counted.get(key, -1) >= have:
                continue  # the same method under two names (records from before a rename): the fuller one
            counted[key] = have
            row.values[key] = m["retention"]
            row.notes.pop(key, None)
            if have < wanted:
                row.notes[key] = f"{have} of {wanted} samples so far"
        tasks = len({key for key, score in dense.items() if score >= DENSE_FLOOR})
        row.benchmark = f"RULER {summary[0]['length'] // 1024}K, {tasks} tasks: retention"
        rows.append(row)
    return rows


def needle_rows() -> list[Row]:
    rows = []
    for model, name in NEEDLES:
        result = json.loads((RESULTS / name).read_text())
        for length, entry in result["lengths"].items():
            summary = entry["summary"]
            row = Row(
                model,
                f"needles {int(length) // 1024}K, {summary['dense']['samples']}: correct",
                str(summary["dense"]["correct"]),
                {},
                f"`{name}`",
                "d",
                made_by(RESULTS / name),
                scale=summary["dense"]["correct"] or None,
            )
            for key, spec in result["specs"].items():
                column = column_of(spec)
                if key != "dense" and key in summary and column is not None:
                    row.values[column, spec["budget"]["density"]] = summary[key]["correct"]
            rows.append(row)
    return rows


def attention_error_rows() -> list[Row]:
    rows = []
    for model, name, text in ATTENTION_ERROR:
        path = RESULTS / name
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        methods = {method: column_of(spec) for method, spec in result["specs"].items()}
        row = Row(model, f"attention error, {text}: × exact top-k's", "0", {}, f"`{name}`", ".2f", made_by(path))
        for density in DENSITIES:
            per = result["results"].get(str(density), {})
            reference = per.get("oracle-topk", {}).get("mean_error")
            row.values["exact top-k", density] = 1.0  # the reference of the ratio
            for method, column in methods.items():
                if column is not None and method in per and reference and (column, density) not in row.values:
                    row.values[column, density] = per[method]["mean_error"] / reference
        rows.append(row)
    return rows


@cache
def accuracy_rows() -> list[Row]:
    return ruler_rows() + needle_rows() + attention_error_rows()


def accuracy_table() -> str:
    header = ["model", "benchmark (3% / 1% read)", "dense", *COLUMNS, "result", "made by"]
    return _table(header, [row.cells() for row in accuracy_rows()])


def plot_accuracy(path: Path) -> None:
    """The retention rows and the needle rows as a share of dense's, a group of bars per benchmark, a panel per
    density."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in accuracy_rows() if row.scale]
    fig, axes = plt.subplots(1, len(DENSITIES), figsize=(12, 4.2), sharey=True)
    width = 0.8 / len(COLUMNS)
    for ax, density in zip(axes, DENSITIES):
        for i, column in enumerate(COLUMNS):
            heights = [row.values.get((column, density), math.nan) / row.scale for row in rows]
            bars = ax.bar(
                [x + (i - (len(COLUMNS) - 1) / 2) * width for x in range(len(rows))],
                heights,
                width,
                label=column if ax is axes[0] else None,
                color=f"C{i}",
            )
            for bar, row in zip(bars, rows):
                if (column, density) in row.notes:  # a cell still running: hatched and pale
                    bar.set_hatch("//")
                    bar.set_alpha(0.45)
        ax.axhline(1.0, color="grey", linewidth=1, linestyle="--")
        ax.set_xticks(
            range(len(rows)),
            [f"{row.model}\n{row.benchmark.split(':')[0]}" for row in rows],
            rotation=30,
            ha="right",
            fontsize=8,
        )
        ax.set_title(f"{density:.0%} read")
    axes[0].set_ylabel("share of dense's score")
    fig.legend(
        loc="upper center",
        ncol=len(COLUMNS) + 1,
        fontsize=8,
        frameon=False,
        title="hatched: a run not yet complete",
        title_fontsize=8,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speed_table() -> str:
    result = json.loads((RESULTS / SPEED).read_text())
    machine = result["machine"]
    rows = []
    for target in result["targets"]:
        if "speedup_over_dense_fastest" in target:
            rows.append(
                [
                    f"{target['batch']} × {target['context'] // 1024}K",
                    f"{target['density']:.0%}",
                    f"{target['speedup_over_dense_fastest']:.2f}×",
                    f"{target['target']:g}×",
                    "met" if target["met"] else "missed",
                ]
            )
    caption = (
        f"Decode tokens/s of OpenAttention (spec {json.dumps(machine['spec'])} over the defaults of its "
        f"commit: {SPEED_SELECTOR}) over the fastest dense decode, inside `generate`, {machine['device']}, "
        f"{machine['model']}, {machine['layers']} layers (`{SPEED}`). Made by: "
        f"{made_by(RESULTS / SPEED).short()}."
    )
    return caption + "\n\n" + _table(["batch × context", "density", "speed-up", "target", ""], rows)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def demo_output() -> str:
    """What ``oa demo`` printed, as ``oa demo --out benchmarks/results/demo.json`` recorded it."""
    result = json.loads((RESULTS / DEMO).read_text())
    return (
        "```\n"
        + "\n".join(result["output"]).strip("\n")
        + "\n```\n\n"
        + f"Made by: {made_by(RESULTS / DEMO).short()} (`{DEMO}`)."
    )


def provenance_table() -> str:
    """Per result the blocks render, then the other headline results: the machine and the commit that made it, and
    where each was read."""
    made = {row.source: row.made for row in accuracy_rows()}
    made.update({f"`{name}`": made_by(RESULTS / name) for name in (SPEED, DEMO, *OTHERS)})
    return _table(
        ["result", "machine", "commit", "how it is known"],
        [[source, m.machine, m.commit, m.how] for source, m in made.items()],
    )


BLOCKS = {"demo": demo_output, "accuracy": accuracy_table, "speed": speed_table, "provenance": provenance_table}


def render(text: str, tables: dict[str, str]) -> str:
    """``text`` with each marked block's body replaced by its table."""
    for name, table in tables.items():
        begin, end = f"<!-- results:{name} -->\n", f"<!-- /results:{name} -->"
        found = min(text.count(begin), text.count(end))
        pattern = re.compile(rf"({re.escape(begin)})(?:.*?\n)?({re.escape(end)})", re.S)
        if max(text.count(begin), text.count(end)) != 1 or not pattern.search(text):
            raise SystemExit(
                f"the block {name!r} must appear once, as <!-- results:{name} -->, a new line, "
                f"<!-- /results:{name} --> (found {found})"
            )
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the marked blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when a committed block differs")
    args = parser.parse_args(argv)
    tables = {name: make() for name, make in BLOCKS.items()}
    if args.write:
        plot_accuracy(RESULTS / PLOT)
    if not (args.write or args.check):
        print("\n\n".join(tables.values()))
        return 0
    stale = []
    for file, names in TARGETS.items():
        path = ROOT / file
        text = path.read_text(encoding="utf-8")
        missing = [name for name in names if f"<!-- results:{name} -->" not in text]
        if missing:
            raise SystemExit(
                f"{file}: no block for {', '.join(missing)} (<!-- results:NAME --> ... <!-- /results:NAME -->)"
            )
        fresh = render(text, {name: tables[name] for name in names})
        if fresh != text if args.write else GIT_LABEL.sub("…", fresh) != GIT_LABEL.sub("…", text):
            stale.append(file)
            if args.write:
                path.write_text(fresh, encoding="utf-8")
    if args.check and stale:
        print(
            f"results tables out of date in {', '.join(stale)}: python benchmarks/results_tables.py --write",
            file=sys.stderr,
        )
        return 1
    print(f"{'rewrote' if args.write else 'up to date:'} {', '.join(stale) or 'nothing to change'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
