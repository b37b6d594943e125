"""The results tables of README.md, docs/results.md and docs/evaluation.md, rendered from the JSON in
benchmarks/results.

    python benchmarks/results_tables.py            # print the tables
    python benchmarks/results_tables.py --write    # rewrite the marked blocks of the pages in TARGETS,
                                                   # and draw benchmarks/results/headline_accuracy.png
    python benchmarks/results_tables.py --check    # exit 1 when a committed block differs (tests/test_readme.py)

A block sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``. Its figures come from the files below,
never typed by hand. A method is found in a result by what it ran, not by its name: the records' and the results'
resolved specs are compared with ``specs/openattention.yaml`` (the default), ``specs/ablate-selector-qgs.yaml`` (QGS,
the default's selector until issue 54) and ``specs/oracle-topk.yaml`` (exact top-k) — and, for the RULER grid of
docs/evaluation.md, ``specs/vattention.yaml`` and ``specs/quest.yaml`` — budget, sink and local window aside (each
benchmark sets its own). A result measured before a spec got its present name still counts as that spec. Figures
quoted in the pages' sentences are compared with the results by tests/test_doc_figures.py.

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
# Every method a RULER grid is summarised by: the columns, then the baselines (docs/evaluation.md's grid).
METHODS = {**COLUMNS, "vAttention-like": "specs/vattention.yaml", "Quest-like": "specs/quest.yaml"}
DENSITIES = (0.03, 0.01)
# (model, folder of `oa eval` records): RULER, mean retention over the tasks dense can do. A folder not yet run
# (Gemma at 32K: benchmarks/ruler_gemma_32k.sh, on a GPU) has no row until its summary is written.
RULER = [
    ("SmolLM2-135M", "ruler_c3f5e3b_smollm2_4k"),
    ("SmolLM2-135M", "ruler_c3f5e3b_smollm2_8k"),
    ("Gemma-3-270M", "ruler_c3f5e3b_gemma3_270m_8k"),
    ("Gemma-3-270M", "ruler_c3f5e3b_gemma3_270m_32k"),
]
NEEDLES = [("SmolLM2-135M", "retrieval_smollm2-135m.json"), ("Gemma-3-270M", "retrieval_gemma3-270m.json")]
ATTENTION_ERROR = [
    ("SmolLM2-135M", f"attention_error{suffix}.json", text)
    for suffix, text in (("", "essays"), ("_python_docs", "Python's docs"), ("_python_source", "Python's source"))
]
SPEED = "generate_speed.json"
# Issue 57's per-layer runs of the default per head (benchmarks/gpu_report.sh layer), and its target: the fused step at
# 32 × 32K, 1%, at least 8× dense's speed.
LAYER = ["kernel_h200_16x16384.json", "kernel_h200_32x32768.json"]
LAYER_TARGET = {(32, 32768, 0.01): 8.0}
# generate_speed.json records the spec it ran as overrides of the code's defaults; when it ran, the default selector
# was QGS (PQS became the default with issue 54, and its one-program decode step is issue 56's).
SPEED_SELECTOR = "QGS's selection, the default before PQS"
DEMO = "demo.json"
ARCHITECTURES = "architectures.json"  # benchmarks/architectures.py: which decoders are patched, and how
# The other headline results (figures the tables do not render), listed with their provenance on docs/results.md.
OTHERS = [
    "ruler_c3f5e3b_smollm2_4k_cuda_check.json",
    "ablations.json",
    "kernel_h200.json",
    "cuda_consistency.json",
    "cuda_consistency_static.json",
    "mutations.json",
    "step_cost.json",
    "architectures.json",
    "generate_speed_h100.json",
    "kernel_h100_16x16384.json",
    "kernel_h100_32x32768.json",
    "kernel_h100_2x131072.json",
]
# The RULER grid docs/evaluation.md shows in full: every method at every density.
GRID = "ruler_c3f5e3b_smollm2_4k"
PLOT = "headline_accuracy.png"  # written by --write beside the tables (not checked: a PNG's bytes vary)
TARGETS = {
    "README.md": ["demo", "accuracy", "speed"],
    "docs/results.md": ["accuracy", "speed", "layer", "provenance"],
    "docs/evaluation.md": ["accuracy", "needles", "bytes", "ruler-dense", "ruler-grid"],
    "docs/integration.md": ["architectures"],
}
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
def method_identities() -> dict[str, str]:
    import yaml

    return {method: identity(yaml.safe_load((ROOT / path).read_text())) for method, path in METHODS.items()}


def method_of(spec: dict) -> str | None:
    """Which of METHODS a resolved spec is (a column, the vAttention-like or the Quest-like spec), or None."""
    found = identity(spec)
    return next((method for method, known in method_identities().items() if known == found), None)


def column_of(spec: dict) -> str | None:
    """Which table column a resolved spec is: the default, QGS, exact top-k, or None."""
    method = method_of(spec)
    return method if method in COLUMNS else None


def signed(value: float, spec: str = "+.2f") -> str:
    """``format(value, spec)`` with a typographic minus, as the pages write a negative figure."""
    return format(value, spec).replace("-", "−")


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


def gpu_name(machine: str) -> str:
    """A GPU by its model, the way a records file names it: "NVIDIA H100 80GB HBM3" → "H100" (one machine, one
    label, whichever of the two recorded it)."""
    found = re.fullmatch(r"NVIDIA (?:GeForce )?(\S+).*", machine)
    return found[1] if found else machine


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
                machine = gpu_name(provenance["machine"])
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
    machine = gpu_name(machine)
    by_config = result.get("provenance_by_config")  # runs merged from several commits (generate_speed --combine)
    if by_config:
        commits = {}
        for config, made in by_config.items():
            commits.setdefault(recorded_commit(made), []).append(config)
        commit = "; ".join(f"{label} ({', '.join(configs)})" for label, configs in commits.items())
        commit_how = "`provenance_by_config`"
    elif len(result.get("commits") or {}) > 1:  # rows merged from runs at several commits (mutations.py --only)
        named = {c: (c if c == "unrecorded" else f"commit {c[:7]}") for c in result["commits"]}
        commit = "; ".join(f"{named[c]} ({n})" for c, n in result["commits"].items())
        commit_how = "`commits`"
    elif provenance.get("commit"):
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


@dataclass
class Mean:
    """A method's mean over a grid's usable tasks at one density: ``oa report``'s row, the samples it rests on and
    the name its records give the spec."""

    row: dict
    samples: int
    name: str


@dataclass
class RulerGrid:
    """An ``oa eval`` folder summarised as ``oa report`` does (``summarize``, the tasks dense scores at least
    ``DENSE_FLOOR`` on, ``means_over_tasks``), each record's spec found among METHODS by what it ran."""

    folder: str
    records: list[dict]
    names: dict[str, str | None]  # the records' spec name → the method it ran (None: none of METHODS)
    summary: list[dict]  # summarize's RULER rows
    dense: dict[tuple, float]  # (task, length) → dense's score
    usable: list[dict]  # the summary's rows of the tasks dense can do
    wanted: int  # the samples a complete cell has: dense's over the usable tasks
    means: dict[tuple, Mean]  # (method, density) → its mean

    def tasks(self) -> list[str]:
        """The tasks dense can do, in RULER's order."""
        from oa_core.eval.ruler_tasks import TASKS

        usable = {r["task"] for r in self.usable}
        return [task for task in TASKS if task in usable] + sorted(usable - set(TASKS))

    def dense_mean(self) -> float:
        """Dense's mean score over the tasks it can do (``oa report``'s "dense on its tasks")."""
        scores = [r["score"] for r in self.usable if r["spec"] == "dense"]
        return sum(scores) / len(scores) if scores else math.nan

    def rows(self, method: str, task: str) -> dict[float, dict]:
        """density → summarize's row of ``method`` on ``task``."""
        return {
            r["density"]: r
            for r in self.summary
            if r["task"] == task
            and (r["spec"] == "dense" if method == "dense" else self.names.get(r["spec"]) == method)
        }

    def used(self, record: dict, methods=COLUMNS, densities=DENSITIES) -> bool:
        """Whether a record is dense or one of ``methods`` at one of ``densities`` (None: any)."""
        return record["spec"] == "dense" or (
            self.names.get(record["spec"]) in methods and (densities is None or record["density"] in densities)
        )


@cache
def ruler_grid(folder: str) -> RulerGrid:
    from oa_core.eval.records import read_records, summarize
    from oa_core.eval.report import DENSE_FLOOR, means_over_tasks

    records = read_records(RESULTS / folder)
    names: dict[str, str | None] = {}
    for r in records:
        if r["density"] is not None and r["spec"] not in names:
            names[r["spec"]] = method_of(r["resolved_spec"])
    summary = [r for r in summarize(records) if r["metric"] == "ruler"]
    dense = {(r["task"], r["length"]): r["score"] for r in summary if r["spec"] == "dense"}
    usable = [r for r in summary if dense.get((r["task"], r["length"]), 0.0) >= DENSE_FLOOR]
    # The samples a cell should have: per usable task, every sample some record of the task holds (a partial run's
    # dense cells are partial too, so their count would understate it).
    tasks = {(r["task"], r["length"]) for r in usable}
    wanted = len({(r["task"], r["length"], r["sample"]) for r in records if (r["task"], r["length"]) in tasks})
    means: dict[tuple, Mean] = {}
    for m in means_over_tasks(usable):
        key = (names.get(m["spec"]), m["density"])
        if m["spec"] == "dense" or key[0] is None:
            continue
        have = sum(r["samples"] for r in usable if (r["spec"], r["density"]) == (m["spec"], m["density"]))
        if key in means and means[key].samples >= have:
            continue  # the same method under two names (records from before a rename): the fuller one
        means[key] = Mean(m, have, m["spec"])
    return RulerGrid(folder, records, names, summary, dense, usable, wanted, means)


def ruler_rows() -> list[Row]:
    from oa_core.eval.report import DENSE_FLOOR

    rows = []
    for model, folder in RULER:
        if not (RESULTS / folder / "summary.json").is_file():
            continue
        grid = ruler_grid(folder)
        dense = sum(r["samples"] for r in grid.usable if r["spec"] == "dense")
        partial = f" ({dense} of {grid.wanted} samples so far)" if dense < grid.wanted else ""
        row = Row(model, "", f"1{partial}", {}, f"`{folder}/`", ".2f", made_by(RESULTS / folder, grid.used), scale=1.0)
        for (method, density), mean in grid.means.items():
            if method in COLUMNS and density in DENSITIES:
                row.values[method, density] = mean.row["retention"]
                if mean.samples < grid.wanted:
                    row.notes[method, density] = f"{mean.samples} of {grid.wanted} samples so far"
        tasks = len({key for key, score in grid.dense.items() if score >= DENSE_FLOOR})
        row.benchmark = f"RULER {grid.summary[0]['length'] // 1024}K, {tasks} tasks: retention"
        rows.append(row)
    return rows


def needle_methods(result: dict) -> dict[tuple, str]:
    """A retrieval result's (column, density) → the key its summaries and ``scoring_bytes_per_key`` use."""
    found = {}
    for key, spec in result["specs"].items():
        column = column_of(spec)
        if key != "dense" and column is not None:
            found.setdefault((column, spec["budget"]["density"]), key)
    return found


def needle_rows() -> list[Row]:
    rows = []
    for model, name in NEEDLES:
        result = json.loads((RESULTS / name).read_text())
        methods = needle_methods(result)
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
            for column_density, key in methods.items():
                if key in summary:
                    row.values[column_density] = summary[key]["correct"]
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


def _pairs(cells: dict, column: str, spec) -> str:
    """'a / b': a column's figures at 3% and at 1% (``spec``: a format or a function), "—" where it has none."""
    keys = [(column, density) for density in DENSITIES]
    if all(key not in cells for key in keys):
        return "—"
    show = spec if callable(spec) else (lambda value: format(value, spec))
    return " / ".join(show(cells[key]) if key in cells else "—" for key in keys)


def needles_table() -> str:
    """Per model and needle length, beside the accuracy table's counts: the answer's log-likelihood gap to dense and
    the selector's recall of exact top-k's rows for the answer."""
    rows = []
    for model, name in NEEDLES:
        result = json.loads((RESULTS / name).read_text())
        methods = needle_methods(result)
        layers = ", ".join(str(layer) for layer in result["recall_layers"])
        for length, entry in result["lengths"].items():
            summary = entry["summary"]
            where = [model, f"{int(length) // 1024}K, {summary['dense']['samples']}"]
            gaps = {key: summary[k]["logprob_gap"] for key, k in methods.items() if k in summary}
            recall = {
                key: summary[k]["answer_rows_in_shortlist"]
                for key, k in methods.items()
                if summary.get(k, {}).get("answer_rows_in_shortlist") is not None
            }
            rows.append([*where, "answer log-likelihood gap, nats", "0", *(_pairs(gaps, c, signed) for c in COLUMNS)])
            rows.append(
                [
                    *where,
                    f"exact top-k's rows in the shortlist (layers {layers})",
                    "—",
                    *(_pairs(recall, c, ".0%") for c in COLUMNS),
                ]
            )
    made = "; ".join(f"{made_by(RESULTS / name).short()} (`{name}`)" for _, name in NEEDLES)
    caption = (
        "The answer's log-likelihood gap to dense, teacher-forced (mean over the samples, nats), and the share of the "
        "rows exact top-k reads for the answer's first token that the selector's shortlist holds (mean over the "
        f"layers named and the samples; exact top-k's own is 1 by definition). Made by: {made}."
    )
    return caption + "\n\n" + _table(["model", "needles", "measure (3% / 1% read)", "dense", *COLUMNS], rows)


def bytes_table() -> str:
    """What choosing the rows reads per key, as the needle results record it (``scoring_bytes_per_key``)."""
    rows = []
    for model, name in NEEDLES:
        result = json.loads((RESULTS / name).read_text())
        read = {key: result["scoring_bytes_per_key"][k] for key, k in needle_methods(result).items()}
        dense_row = {entry["dense_row"] for entry in read.values()}
        rerank = {key: entry["rerank"] for key, entry in read.items()}
        cells = []
        for column in COLUMNS:
            codes = {read[column, d]["codes"] for d in DENSITIES if (column, d) in read}
            cells.append(
                "—"
                if not codes
                else f"{'/'.join(format(c, 'g') for c in sorted(codes))}; {_pairs(rerank, column, 'g')}"
            )
        rows.append(
            [f"{model} ({result['head_dim']})", *cells, "/".join(str(d) for d in sorted(dense_row)), f"`{name}`"]
        )
    caption = (
        "Bytes read per key of the context to choose the rows, keys and values in bf16: the selector's codes (exact "
        "top-k: the keys), then the re-rank's share of the shortlist's exact keys at 3% / 1% read; a dense row is "
        "2·D·2 bytes."
    )
    return caption + "\n\n" + _table(["model (head dim)", *COLUMNS, "dense row", "result"], rows)


def _ruler_score(row: dict, spec: str = ".1f") -> str:
    """A summary row's score to one decimal as ``oa report`` writes it (``spec="g"``: without a trailing .0), with
    its 95% interval: '52.5 (32–72)'."""
    from oa_core.eval.records import interval

    return format(round(row["score"], 1), spec) + interval(row)


def ruler_dense_table(folder: str = GRID) -> str:
    """Dense's score on every task of a grid, with its 95% interval, and whether the methods ran on it."""
    from oa_core.eval.report import DENSE_FLOOR
    from oa_core.eval.ruler_tasks import TASKS

    grid = ruler_grid(folder)
    dense = {task: rows[1.0] for task in TASKS if (rows := grid.rows("dense", task))}
    usable = set(grid.tasks())
    samples = sorted({row["samples"] for row in dense.values()})
    caption = (
        f"Dense, {'/'.join(map(str, samples))} samples a task (95% intervals), `{folder}/`; the methods run on the "
        f"tasks it scores at least {DENSE_FLOOR:g} on."
    )
    return (
        caption
        + "\n\n"
        + _table(
            ["task", *dense],
            [
                ["score", *(_ruler_score(row, "g") for row in dense.values())],
                ["methods run", *("yes" if task in usable else "no" for task in dense)],
            ],
        )
    )


def ruler_grid_table(folder: str = GRID) -> str:
    """Every method of a grid at every density: mean score over the usable tasks (95% interval) / retention /
    log-likelihood gap, as ``oa report``'s means; a method named by the spec it ran and the name its records give."""
    import yaml

    grid = ruler_grid(folder)
    densities = sorted({density for _, density in grid.means}, reverse=True)
    per_task = sorted({r["samples"] for r in grid.usable if r["spec"] == "dense"})
    rows, renamed = [], []
    for method in METHODS:
        means = {density: grid.means[method, density] for density in densities if (method, density) in grid.means}
        if not means:
            continue
        names = sorted({mean.name for mean in means.values()})
        ran = next(r["resolved_spec"] for r in grid.records if r["spec"] in names)
        cells = []
        for density in densities:
            mean = means.get(density)
            if mean is None:
                cells.append("—")
                continue
            m = mean.row
            cell = f"{_ruler_score(m)} / {m['retention']:.2f} / {signed(m['logprob_gap'])}"
            if mean.samples < grid.wanted:
                cell += f" ({mean.samples} of {grid.wanted} samples so far)"
            cells.append(cell)
        rows.append([method, f"`{ran['selector']['name']}`", ", ".join(f"`{name}`" for name in names), *cells])
        for name in names:
            path = ROOT / "specs" / f"{name}.yaml"
            if path.is_file() and name != Path(METHODS[method]).stem:
                now = method_of(yaml.safe_load(path.read_text()))
                renamed.append(f"`specs/{name}.yaml` held {_the(method)} when `{name}` ran; it now holds {_the(now)}")
    caption = (
        f"Mean over the {len(grid.tasks())} tasks dense can do ({', '.join(grid.tasks())}; dense "
        f"{grid.dense_mean():.1f} on them; {'/'.join(map(str, per_task))} samples a task, {grid.wanted} a cell), "
        f"`{folder}/`. Each cell: mean score (95% interval) / retention (the mean over tasks of score / dense score) "
        "/ the answer's log-likelihood gap to dense, teacher-forced, in nats; — where the method did not run. A method "
        "is found by the spec it ran, whatever its records call it"
        + (f" ({'; '.join(renamed)})" if renamed else "")
        + f". Made by: {made_by(RESULTS / folder, lambda r: grid.used(r, METHODS, None)).short()}."
    )
    header = ["method", "selector", "records' name", *(f"{density:.0%}" for density in densities)]
    return caption + "\n\n" + _table(header, rows)


def _the(method: str | None) -> str:
    return "the default" if method == "default" else method or "another method"


def speed_table() -> str:
    """generate_speed.json's OpenAttention runs over dense-fastest, each with its prepare share and the issue's target
    where it sets one. Runs from before records named their spec (generate_speed's old JSON) take the caption's."""
    result = json.loads((RESULTS / SPEED).read_text())
    machine = result["machine"]
    prepare = {
        (t["batch"], t["context"], t.get("spec"), t.get("gqa"), t["density"]): t["prepare_over_prefill"]
        for t in result["targets"]
        if "prepare_over_prefill" in t
    }
    rows = []
    for target in result["targets"]:
        if "speedup_over_dense_fastest" not in target:
            continue
        key = (target["batch"], target["context"], target.get("spec"), target.get("gqa"), target["density"])
        share = prepare.get(key)
        rows.append(
            [
                f"{target['batch']} × {target['context'] // 1024}K",
                f"`{Path(target['spec']).stem}`, {target['gqa']}" if target.get("spec") else "see above",
                f"{target['density']:.0%}",
                f"{target['speedup_over_dense_fastest']:.2f}×",
                "" if target["target"] is None else f"{target['target']:g}×",
                "" if target["met"] is None else "met" if target["met"] else "missed",
                "" if share is None else f"{share:.1%}",
            ]
        )
    which = (
        f"spec {json.dumps(machine['spec'])} over the defaults of its commit: {SPEED_SELECTOR}"
        if "spec" in machine
        else "specs named by file and GQA mode"
    )
    caption = (
        f"Decode tokens/s of OpenAttention ({which}) over the fastest dense decode, inside `generate`, "
        f"{machine['device']}, {machine['model']}, {machine['layers']} layers (`{SPEED}`); prepare: its share of the "
        f"model's prefill (target 10%). Made by: {made_by(RESULTS / SPEED).short()}."
    )
    header = ["batch × context", "spec, GQA", "density", "speed-up", "target", "", "prepare"]
    return caption + "\n\n" + _table(header, rows)


def layer_table() -> str:
    """The default's decode step per layer (``kernel_h200.py``'s fused static step, per head) against dense SDPA, in
    CUDA graphs and eagerly, the target where the issue sets one, and the step's kernels by time (the profiler's)."""
    rows, machines = [], set()
    for name in LAYER:
        result = json.loads((RESULTS / name).read_text())
        machines.add(made_by(RESULTS / name).short())
        for run in result["results"]:
            speed = run["dense_graph_ms"] / run["static_step_graph_ms"]
            target = LAYER_TARGET.get((run["batch"], run["context"], run["density"]))
            kernels = sorted(run["static_step_kernels_ms"].items(), key=lambda item: -item[1])
            rows.append(
                [
                    f"{run['batch']} × {run['context'] // 1024}K",
                    f"{run['density']:.0%}",
                    f"{run['dense_graph_ms']:.3f}",
                    f"{run['static_step_graph_ms']:.3f}",
                    f"{run['static_step_ms']:.3f}",
                    # the same step with Triton's three shortlist launches, where the CUDA one ran (sm_90+)
                    f"{run['static_step_triton_shortlist_graph_ms']:.3f}" if "static_step_shortlist" in run else "",
                    f"{speed:.2f}×",
                    "" if target is None else f"{target:g}×, {'met' if speed >= target else 'missed'}",
                    ", ".join(f"`{k.removeprefix('void ').strip()}` {ms:.2f}" for k, ms in kernels[:6]),
                ]
            )
    caption = (
        f"The default (`{result['spec']}`) per head, one layer's decode step (the fused static step: grow + attend) "
        f"against dense SDPA, Llama-3.1-8B shape, ms (`{'`, `'.join(LAYER)}`: `bash benchmarks/gpu_report.sh layer`, "
        f"which runs `benchmarks/kernel_h200.py` per head at each batch × context). The step takes PQS's shortlist in "
        "one CUDA launch and Triton's `exact_logits` where the GPU allows (sm_90+, nvcc: "
        "`oa_plugins.kernels.pq_shortlist_cuda`); beside it, the same step with Triton's three launches instead. "
        "Made by: "
        f"{'; '.join(sorted(machines))}."
    )
    header = ["batch × context", "density", "dense", "step, graphed", "step, eager", "Triton's shortlist, graphed"]
    header += ["speed", "target", "kernels, ms"]
    return caption + "\n\n" + _table(header, rows)


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


def architectures_table() -> str:
    """``architectures.json``: per architecture, whether the patched model generates the unpatched one's tokens at a
    full budget (default cache / static cache), its layers that decode sparsely at 20%, and those that keep the model's
    own attention, with the stats' reason up to its first comma or parenthesis."""
    result = json.loads((RESULTS / ARCHITECTURES).read_text())
    rows = []
    for r in result["records"]:
        if r["error"]:
            rows.append([f"`{r['model_type']}`", "", "", "", f"not patched: {r['error']}"])
            continue
        same = r["full_budget_same_tokens"]
        kept = "; ".join(
            f"{', '.join(map(str, layers))}: {re.split(r'[,(]', reason.removeprefix('dense: '))[0].strip()}"
            for reason, layers in r["kept_own"].items()
        )
        rows.append(
            [
                f"`{r['model_type']}`",
                f"`{r['attention']}` ({r['implementation']})",
                " / ".join("yes" if same[cache] else "**no**" for cache in ("default cache", "static cache")),
                ", ".join(map(str, r["sparse_layers"])) or "none",
                kept,
            ]
        )
    setup = result["setup"]
    caption = (
        f"Tiny random models of transformers' architectures ({setup['config']['num_hidden_layers']} layers, "
        f"transformers {result['transformers']}), patched (`benchmarks/architectures.py`, `{ARCHITECTURES}`): at a "
        "budget that covers the context, the patched model's tokens against the unpatched model's; at 20%, the layers "
        "that decode sparsely and those that keep the model's own attention, and why. "
        f"Made by: {made_by(RESULTS / ARCHITECTURES).short()}."
    )
    header = ["architecture", "attention", "full budget = unpatched (default / static cache)", "sparse", "kept own"]
    return caption + "\n\n" + _table(header, rows)


def provenance_table() -> str:
    """Per result the blocks render, then the other headline results: the machine and the commit that made it, and
    where each was read."""
    made = {row.source: row.made for row in accuracy_rows()}
    made.update({f"`{name}`": made_by(RESULTS / name) for name in (SPEED, *LAYER, DEMO, *OTHERS)})
    return _table(
        ["result", "machine", "commit", "how it is known"],
        [[source, m.machine, m.commit, m.how] for source, m in made.items()],
    )


BLOCKS = {
    "demo": demo_output,
    "accuracy": accuracy_table,
    "speed": speed_table,
    "layer": layer_table,
    "provenance": provenance_table,
    "needles": needles_table,
    "bytes": bytes_table,
    "ruler-dense": ruler_dense_table,
    "ruler-grid": ruler_grid_table,
    "architectures": architectures_table,
}


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
