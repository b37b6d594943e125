"""``oa report DIR``: what an ``oa eval`` folder holds, as Markdown and plots.

- ``summary.csv`` / ``summary.json``: rewritten from the records (as ``oa eval`` writes them at its end).
- ``report.md``: the RULER generator that made the samples (records of two generators are refused unless
  ``--generator`` picks one); per spec and density, averaged over the tasks dense can do (score with its 95% Wilson
  interval, retention vs dense, answer log-likelihood gap, measured density); the same per task; and the tasks the
  model cannot do even dense; what each spec's selection reads per key (its codes, its re-rank's keys) beside a
  dense row, from the records' resolved specs and the model's head size.
- ``accuracy_vs_density.png``: mean retention against read density, a line per method, dense as a level (the paper's
  figure); ``per_task.png``: a bar per method and task with its 95% interval, a panel per density.
- For ``--metric attention-error`` records: the mean relative output error per spec and density, and
  ``error_vs_density.png``.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from pathlib import Path

from oa_core.eval.records import (
    ATTENTION_ERROR,
    LEGACY_GENERATOR,
    fmt,
    generator_of,
    interval,
    read_records,
    summarize,
    summary_table,
    wilson_interval,
    write_summary,
)

# A task dense scores below this (of 100) cannot measure retention: reported apart, left out of the means.
DENSE_FLOOR = 20.0


def build_report(out: str | Path, dense_floor: float = DENSE_FLOOR, generator: str | None = None) -> Path:
    """Writes report.md and the PNGs into ``out`` (an ``oa eval`` folder) → the report's path. Its RULER records
    must come from one generator, or ``generator`` picks one (a ValueError lists them otherwise)."""
    out = Path(out)
    records = read_records(out)
    if not records:
        raise FileNotFoundError(f"{out}: no records*.jsonl here; run `oa eval --out {out}` first")
    records = _one_generator(records, out, generator)
    every = summarize(records)
    write_summary(out, every)  # as of these records (a run cut short never wrote its own)
    errors = [r for r in every if r["metric"] == ATTENTION_ERROR]
    rows = [r for r in every if r["metric"] != ATTENTION_ERROR]
    dense = {(r["task"], r["length"]): r["score"] for r in rows if r["spec"] == "dense"}
    unable = sorted({f"{task} ({length})" for (task, length), score in dense.items() if score < dense_floor})
    usable = [r for r in rows if dense.get((r["task"], r["length"]), 0.0) >= dense_floor]
    means = means_over_tasks(usable)
    lines = [
        f"# Evaluation report: `{out}`",
        "",
        f"{len(records)} cells; model: {records[0].get('model', '?')}; setup {records[0].get('setup', '?')}; "
        f"seed {records[0].get('seed', '?')}.",
        "",
    ]
    if rows:
        lines += [_generator_line(rows[0]["generator"]), ""]
    if errors:
        lines += _error_section(errors, out)
    if not rows:
        path = out / "report.md"
        path.write_text("\n".join(lines), encoding="utf-8")
        return path
    lines += [f"## Mean over the tasks dense scores at least {dense_floor:g} on", ""]
    if means:
        lines += [_means_table(means), ""]
    else:
        lines += ["No task reached that dense score: retention cannot be measured.", ""]
    lines += _bytes_section(records)
    lines += [
        "## Tasks the model cannot do even dense",
        "",
        ", ".join(unable) if unable else f"None (every task's dense score ≥ {dense_floor:g}).",
        "",
        "## Per task",
        "",
        summary_table(rows),
        "",
        "![accuracy vs density](accuracy_vs_density.png)",
        "",
        "![per task](per_task.png)",
        "",
    ]
    if means:
        plot_accuracy_vs_density(means, out / "accuracy_vs_density.png")
    else:  # no task dense can do: no retention to plot, the raw scores instead
        plot_accuracy_vs_density(
            means_over_tasks(rows),
            out / "accuracy_vs_density.png",
            ylabel="mean score",
            title="Score against read density",
            key="score",
        )
    plot_per_task(rows, out / "per_task.png")
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _one_generator(records: list[dict], out: Path, generator: str | None) -> list[dict]:
    """The records of one RULER generator (and every attention-error record): scores of different generators' samples
    never share a table."""
    found = sorted({generator_of(r) for r in records} - {""})
    if generator is not None:
        if generator not in found:
            raise ValueError(f"generator: {out} has no RULER records of {generator!r}; it has {', '.join(found)}")
        return [r for r in records if generator_of(r) in ("", generator)]
    if len(found) > 1:
        counts = ", ".join(f"{g} ({sum(generator_of(r) == g for r in records)} cells)" for g in found)
        raise ValueError(
            f"{out} holds RULER records of {len(found)} generators, {counts}; their samples differ and "
            "their scores do not compare: pass --generator NAME for one of them"
        )
    return records


def _generator_line(generator: str) -> str:
    if generator == LEGACY_GENERATOR:
        return (
            f"Samples: `{generator}`, OpenAttention's RULER-like generator before it followed NVIDIA/RULER "
            "(no worked examples for vt and cwe, an easier fwe, plural prompts; docs/evaluation.md). Its scores do "
            "not compare with RULER's, nor with a later generator's."
        )
    return f"Samples: `{generator}`, NVIDIA/RULER's generator at that commit, offline (docs/evaluation.md)."


def _error_section(rows: list[dict], out: Path) -> list[str]:
    """attention-error rows: the mean relative output error over layers per spec, density and length, and its plot."""
    table = ["| spec | density | length | layers | mean relative error | measured density |", "|" + "---|" * 6]
    for r in rows:
        table.append(
            f"| {r['spec']} | {r['density']:.0%} | {r['length']} | {r['samples']} | {r['score']:.4f} | "
            f"{r['measured_density']:.4f} |"
        )
    plot_accuracy_vs_density(
        means_over_tasks(rows),
        out / "error_vs_density.png",
        ylabel="mean relative error ‖ô − o‖/‖o‖",
        title="Attention error against read density",
        key="score",
    )
    return [
        "## Attention error on the model's own caches",
        "",
        "\n".join(table),
        "",
        "![error vs density](error_vs_density.png)",
        "",
    ]


def _bytes_section(records: list[dict]) -> list[str]:
    """Per sparse spec and density: the bytes per key of the context its selection reads (``Pipeline.scoring_bytes``),
    from a record's resolved spec and the model's head size (a folder holds one model's records; those written
    before records had ``head_dim`` take it from the others). Empty when no record has it."""
    from oa_core.pipeline import build

    head_dim = next((r["head_dim"] for r in records if r.get("head_dim")), None)
    specs = {(r["spec"], r["density"]): r for r in records if r.get("density") is not None}
    if head_dim is None or not specs:
        return []
    lines = [
        "## What the selection reads per key",
        "",
        "Bytes per key of the context, keys and values in bf16; a dense row is 2·D·2 bytes.",
        "",
        "| spec | density | head dim | codes or bounds | re-rank's keys | dense row |",
        "|" + "---|" * 6,
    ]
    for (spec, density), r in sorted(specs.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        read = build(r["resolved_spec"]).scoring_bytes(head_dim)
        lines.append(
            f"| {spec} | {density:.0%} | {head_dim} | {fmt(read['codes'], '.4g')} | "
            f"{read['rerank']:.4g} | {read['dense_row']} |"
        )
    return [*lines, ""]


def means_over_tasks(rows: list[dict]) -> list[dict]:
    """Per (spec, density): the mean over tasks and lengths of score, retention, log-likelihood gap and density."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["spec"], r["density"]].append(r)

    def mean(values):
        values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
        return sum(values) / len(values) if values else math.nan

    keys = ("score", "dense_score", "retention", "logprob_gap", "measured_density")
    means = []
    for (spec, density), rs in sorted(groups.items(), key=lambda g: (g[0][0], -g[0][1])):
        row = {"spec": spec, "density": density, "tasks": len(rs), **{k: mean(r[k] for r in rs) for k in keys}}
        if rs[0]["metric"] == "ruler":  # the interval of the mean over every sample of these tasks
            row["score_low"], row["score_high"] = wilson_interval(row["score"], sum(r["samples"] for r in rs))
        means.append(row)
    return means


def _means_table(means: list[dict]) -> str:
    lines = [
        "| spec | density | tasks | score (95% interval) | dense on its tasks | retention | log-lik gap | "
        "measured density |",
        "|" + "---|" * 8,
    ]
    for m in means:
        lines.append(
            f"| {m['spec']} | {m['density']:.0%} | {m['tasks']} | {m['score']:.1f}{interval(m)} | "
            f"{fmt(m['dense_score'], '.1f')} | {fmt(m['retention'], '.2f')} | "
            f"{fmt(m['logprob_gap'], '+.2f')} | {m['measured_density']:.4f} |"
        )
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


ABLATION_PREFIX = "ablate-"  # specs/ablate-*.yaml: OpenAttention with one component changed


def _colors(specs) -> dict[str, tuple]:
    """One colour per spec, the same in every panel and plot. Methods and ablations draw from separate palettes
    (tab10, tab20b), so a method keeps its colour in reports with and without ablations (the 4K and 8K sweeps)."""
    plt = _pyplot()
    colors: dict[str, tuple] = {}
    for palette, ablations in (("tab10", False), ("tab20b", True)):
        group = sorted(s for s in set(specs) - {"dense"} if s.startswith(ABLATION_PREFIX) == ablations)
        colors.update(zip(group, itertools.cycle(plt.get_cmap(palette).colors)))
    return colors


def _markers(specs) -> dict[str, str]:
    """One marker shape per spec, methods and ablations each in their own order (as ``_colors``): a line that lies
    on another is still told apart."""
    markers: dict[str, str] = {}
    for ablations in (False, True):
        group = sorted(s for s in set(specs) - {"dense"} if s.startswith(ABLATION_PREFIX) == ablations)
        markers.update(zip(group, itertools.cycle("osD^vP*Xh<>p")))
    return markers


def plot_accuracy_vs_density(
    means: list[dict],
    path: Path,
    ylabel: str = "mean retention (score / dense, same samples)",
    title: str = "Retention against read density",
    key: str = "retention",
) -> None:
    """A line per method of ``key`` against read density, dense as a level. RULER plots retention: a method's
    cells may cover fewer tasks than dense's (a sweep in progress), and retention compares each on its own tasks.
    With ablation specs, two panels: the methods, and OpenAttention beside its ablations."""
    plt = _pyplot()
    by_spec: dict[str, list[dict]] = defaultdict(list)
    for m in means:
        by_spec[m["spec"]].append(m)
    methods = [s for s in sorted(by_spec) if not s.startswith(ABLATION_PREFIX)]
    ablations = [s for s in sorted(by_spec) if s.startswith(ABLATION_PREFIX)]
    panels = [("methods", methods)]
    if ablations:
        panels.append(
            ("ablations of OpenAttention", [s for s in ("dense", "openattention") if s in by_spec] + ablations)
        )
    colors, markers = _colors(by_spec), _markers(by_spec)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 5.0), dpi=120, squeeze=False, sharey=True)
    ticks = sorted({100 * m["density"] for m in means if m["spec"] != "dense"})
    dense_tasks = max((m["tasks"] for m in by_spec.get("dense", [])), default=None)
    for ax, (name, specs) in zip(axes[0], panels):
        # OpenAttention drawn last, on top; a marker per method, hollow, so lines that coincide stay visible.
        for spec in sorted(specs, key=lambda s: s == "openattention"):
            ms = sorted(by_spec[spec], key=lambda m: m["density"])
            if spec == "dense":
                ax.axhline(ms[0][key], color="black", linestyle="--", linewidth=1, label="dense")
                continue
            fewest = min(m["tasks"] for m in ms)
            label = (
                spec if dense_tasks is None or fewest >= dense_tasks else f"{spec} ({fewest} of {dense_tasks} tasks)"
            )
            ax.plot(
                [100 * m["density"] for m in ms],
                [m[key] for m in ms],
                marker=markers[spec],
                label=label,
                color=colors[spec],
                markerfacecolor="none",
                markersize=8 if spec == "openattention" else 6,
                linewidth=2.5 if spec == "openattention" else 1.5,
                zorder=3 if spec == "openattention" else 2,
            )
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}%" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("read density")
        ax.set_title(f"{title}: {name}" if len(panels) > 1 else title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    axes[0, 0].set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_per_task(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    densities = sorted({r["density"] for r in rows if r["spec"] != "dense"}, reverse=True) or [1.0]
    tasks = sorted({(r["task"], r["length"]) for r in rows})
    specs = sorted({r["spec"] for r in rows})
    score = {(r["spec"], r["density"], r["task"], r["length"]): r for r in rows}
    fig, axes = plt.subplots(
        len(densities), 1, figsize=(max(6.4, 1.2 * len(tasks) + 2), 2.8 * len(densities)), dpi=120, squeeze=False
    )
    width = 0.8 / max(len(specs), 1)
    colors = {**_colors(specs), "dense": (0.2, 0.2, 0.2)}
    for ax, density in zip(axes[:, 0], densities):
        for i, spec in enumerate(specs):
            cells = [score.get((spec, 1.0 if spec == "dense" else density, t, n)) for t, n in tasks]
            values = [c["score"] if c else math.nan for c in cells]
            below = [c["score"] - c["score_low"] if c else math.nan for c in cells]  # the 95% interval
            above = [c["score_high"] - c["score"] if c else math.nan for c in cells]
            ax.bar(
                [x + i * width for x in range(len(tasks))],
                values,
                width=width,
                label=spec,
                color=colors[spec],
                yerr=[below, above],
                error_kw={"elinewidth": 0.6, "capsize": 1.5, "ecolor": (0.3, 0.3, 0.3)},
            )
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(tasks))])
        ax.set_xticklabels([f"{t}\n{n}" for t, n in tasks], fontsize=7)
        ax.set_ylabel("score (bars: 95% interval)")
        ax.set_ylim(0, 100)
        ax.set_title(f"read density {density:.0%}", fontsize=9)
    axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside the bars
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
