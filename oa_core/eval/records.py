"""What ``oa eval`` writes: one typed record per (spec, density, task, length, sample) cell, appended to
``records[-rankR].jsonl`` and flushed at once; and the summary over them (``summary.csv`` / ``summary.json``)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ATTENTION_ERROR = "attention-error"  # the metric, and the task name of its records (a unit: one layer at one length)
METRICS = ("ruler", ATTENTION_ERROR)
SUMMARY_FIELDS = (
    "metric",
    "generator",
    "spec",
    "density",
    "task",
    "length",
    "samples",
    "score",
    "score_low",
    "score_high",
    "dense_score",
    "retention",
    "logprob_gap",
    "measured_density",
)
# The RULER generator of records written before they named theirs: OpenAttention's own RULER-like tasks (without
# RULER's worked examples, singular prompts and fwe's noise word; docs/evaluation.md).
LEGACY_GENERATOR = "oa-ruler-v2"
Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


@dataclass
class Record:
    """The fields every record has. ``density``: the spec's target (None for the dense reference); ``sample``: the
    sample's index (attention-error: the layer); ``resolved_spec``: the spec as it ran (budget, sink, local, ...,
    every component's params, defaults included: ``Pipeline.resolved_spec``; older records name only those given);
    ``model``, ``head_dim`` (its attention head's size D), ``setup``, ``seed``, ``metric``, ``versions``: the run's;
    ``provenance``: the run's commit and machine (``oa_core.analysis.provenance``; None in older records)."""

    spec: str
    density: float | None
    task: str
    length: int
    sample: int
    score: float
    answer_logprob: float | None
    measured_density: float
    resolved_spec: dict
    model: str
    head_dim: int
    setup: str
    seed: int
    metric: str
    versions: dict
    provenance: dict | None = None

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class RulerRecord(Record):
    """A RULER cell: the score (string match, ×100) of the greedy ``output`` against the ``answers`` of a sample
    ``generator`` made; the prompt's
    token counts; the batch it ran in (its density, times and peaks are the batch's); where it ran; the GPU memory
    allocated at most during the prefill and the cell (GiB; None on the CPU)."""

    generator: str = ""  # the RULER generator that made the sample (ruler.GENERATOR)
    output: str = ""
    answers: list[str] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    context_tokens: int = 0
    question_tokens: int = 0
    batch: int = 1
    prefill_s: float = 0.0
    generate_s: float = 0.0
    device: str = "cpu"
    prefill_peak_gib: float | None = None
    peak_gib: float | None = None


@dataclass
class ErrorRecord(Record):
    """An attention-error cell: ``score`` is the mean relative output error ‖ô − o‖/‖o‖ over the layer's query heads
    and decode queries, ``p90_error`` its 90th percentile; with ``--diagnostics`` also ``diagnostics`` (E, top-32
    recall, what the components measure), written as fields of their own."""

    p90_error: float = 0.0
    decode_queries: int = 0
    seconds: float = 0.0
    diagnostics: dict[str, float] = dataclasses.field(default_factory=dict)

    def as_json(self) -> dict:
        fields = dataclasses.asdict(self)
        diagnostics = fields.pop("diagnostics")
        return {**fields, **diagnostics}


def cell_key(spec: str, density: float | None, task: str, length: int, sample: int) -> tuple:
    return spec, None if density is None else round(float(density), 6), task, int(length), int(sample)


def record_key(record: dict) -> tuple:
    return cell_key(record["spec"], record["density"], record["task"], record["length"], record["sample"])


def generator_of(record: dict) -> str:
    """The RULER generator behind a record ("" for attention-error records, which use none)."""
    if record.get("metric", "ruler") != "ruler":
        return ""
    return record.get("generator") or LEGACY_GENERATOR


def wilson_interval(mean: float, samples: int, scale: float = 100.0) -> tuple[float, float]:
    """The 95% Wilson score interval of a mean score on ``scale`` over ``samples`` samples. Exact for pass/fail
    scores; for partial credit (string_match_all over several answers) conservative, since a score in [0, 1] of mean
    p varies at most as p(1 − p)."""
    p, n = min(max(mean / scale, 0.0), 1.0), samples
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 / (1 + Z95**2 / n) * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n))
    return scale * max(centre - half, 0.0), scale * min(centre + half, 1.0)


def read_records(out: Path) -> list[dict]:
    """Every complete record under ``out`` (a line cut short by a crash is skipped: its cell runs again)."""
    records = []
    for path in sorted(out.glob("records*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class RecordWriter:
    """Appends records to one JSON-lines file, each flushed to disk before the next cell starts."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        cut_short = path.is_file() and path.stat().st_size and path.read_bytes()[-1:] != b"\n"
        self.file = path.open("a", encoding="utf-8")
        if cut_short:  # a line a crash left unfinished stays alone on its line (and is skipped when read)
            self.file.write("\n")

    def write(self, record: Record) -> None:
        self.file.write(json.dumps(record.as_json()) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


def summarize(records: list[dict]) -> list[dict]:
    """One row per (generator, spec, density, task, length): mean score and its 95% interval (``wilson_interval``),
    the dense reference's on the same samples, retention = score / dense score, mean log-likelihood gap to dense
    (nats), mean measured density. Samples of different generators never meet in a row nor pair with each other. For
    the attention-error metric the score is the mean relative error (lower is better; dense's is ~0, so no retention
    and no interval)."""
    latest = {(generator_of(r), *record_key(r)): r for r in records}  # a cell written twice (resumed) counts once
    dense = {(generator_of(r), r["task"], r["length"], r["sample"]): r for r in latest.values() if r["density"] is None}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in latest.values():
        groups[generator_of(r), r["spec"], r["density"], r["task"], r["length"]].append(r)
    rows = []
    for (generator, spec, density, task, length), rs in sorted(
        groups.items(), key=lambda g: (g[0][0], g[0][1], -(g[0][2] or 2), g[0][3], g[0][4])
    ):
        metric = rs[0].get("metric", "ruler")
        digits = 6 if metric == ATTENTION_ERROR else 2
        paired = [
            (r, dense[generator, r["task"], r["length"], r["sample"]])
            for r in rs
            if (generator, r["task"], r["length"], r["sample"]) in dense
        ]
        gaps = [
            r["answer_logprob"] - d["answer_logprob"]
            for r, d in paired
            if r.get("answer_logprob") is not None and d.get("answer_logprob") is not None
        ]
        score = sum(r["score"] for r in rs) / len(rs)
        low, high = wilson_interval(score, len(rs)) if metric == "ruler" else (math.nan, math.nan)
        dense_score = sum(d["score"] for _, d in paired) / len(paired) if paired else math.nan
        rows.append(
            {
                "metric": metric,
                "generator": generator,
                "spec": spec,
                "density": density if density is not None else 1.0,
                "task": task,
                "length": length,
                "samples": len(rs),
                "score": round(score, digits),
                "score_low": round(low, digits),
                "score_high": round(high, digits),
                "dense_score": round(dense_score, digits),
                "retention": round(score / dense_score, 4) if metric == "ruler" and dense_score else math.nan,
                "logprob_gap": round(sum(gaps) / len(gaps), 4) if gaps else math.nan,
                "measured_density": round(sum(r["measured_density"] for r in rs) / len(rs), 4),
            }
        )
    return rows


def write_summary(out: Path, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "summary.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


def summary_table(rows: list[dict]) -> str:
    """The summary as a Markdown table: a RULER score with its 95% interval (attention-error scores are relative
    errors: four decimals); a column naming the generator when the rows come from more than one."""
    several = len({r.get("generator", "") for r in rows}) > 1
    head = ("| generator " if several else "") + (
        "| spec | density | task | length | samples | score (95% interval) | "
        "dense | retention | log-lik gap | measured density |"
    )
    lines = [head, "|" + "---|" * (10 + several)]
    for r in rows:
        digits = ".4f" if r["metric"] == ATTENTION_ERROR else ".1f"
        lead = f"| {r.get('generator', '')} " if several else ""
        lines.append(
            f"{lead}| {r['spec']} | {r['density']:.0%} | {r['task']} | {r['length']} | {r['samples']} | "
            f"{fmt(r['score'], digits)}{interval(r)} | {fmt(r['dense_score'], digits)} | "
            f"{fmt(r['retention'], '.2f')} | {fmt(r['logprob_gap'], '+.2f')} | {r['measured_density']:.4f} |"
        )
    return "\n".join(lines)


def interval(row: dict) -> str:
    """`` (low–high)`` of a row's score interval, or nothing where it has none."""
    low, high = row.get("score_low", math.nan), row.get("score_high", math.nan)
    return "" if low is None or math.isnan(low) else f" ({low:.0f}–{high:.0f})"


def fmt(value: float | None, spec: str) -> str:
    """``format(value, spec)``, or n/a for None and NaN (a figure that does not apply)."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
