"""The figures the pages quote in their sentences, compared with the results they come from (issue 55: every number
in the README and the docs is rendered from a JSON in benchmarks/results or compared with it by a test).

Tables are rendered by benchmarks/results_tables.py (tests/test_readme.py checks them); a figure in a sentence is
listed here: the page, the text as the page has it, and how that text follows from a named result. Each test asserts
both that the page holds the text and that the result gives it, so an edited page and a changed result both fail.
A RULER folder is read as ``oa report`` reads it and its methods found by the spec they ran
(``results_tables.ruler_grid``); a needle result's methods likewise (``results_tables.needle_methods``).
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GRID_4K = "ruler_c3f5e3b_smollm2_4k"
GRID_8K = "ruler_c3f5e3b_smollm2_8k"
GEMMA_8K = "ruler_c3f5e3b_gemma3_270m_8k"
CUDA_CHECK = "ruler_c3f5e3b_smollm2_4k_cuda_check.json"
WORDS = dict(enumerate(["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]))


@cache
def tables():
    return load_benchmark("results_tables")


@cache
def result(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


@cache
def page(path: str) -> str:
    """The page's text with every run of white space one space (a quote may cross a line break)."""
    return " ".join((ROOT / path).read_text(encoding="utf-8").split())


def signed(value: float, spec: str = "+.2f") -> str:
    return tables().signed(value, spec)


def listing(items) -> str:
    """'a, b and c'."""
    items = [str(item) for item in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def percents(densities) -> str:
    return listing(f"{density:.0%}" for density in sorted(densities, reverse=True))


# -- needles: retrieval_<model>.json -----------------------------------------------------------------------------


def needle(model: str, length: int, column: str, density: float | None = None) -> dict:
    """A retrieval result's summary of ``column`` (or "dense") at ``density``, found by the spec it ran."""
    run = result(f"retrieval_{model}.json")
    summary = run["lengths"][str(length)]["summary"]
    return summary["dense"] if column == "dense" else summary[tables().needle_methods(run)[column, density]]


def pair(model: str, length: int, column: str, show: Callable[[dict], str], joint: str = " and ") -> str:
    return joint.join(show(needle(model, length, column, density)) for density in tables().DENSITIES)


def correct(entry: dict) -> str:
    return str(entry["correct"])


def gap(entry: dict) -> str:
    return signed(entry["logprob_gap"], "+.2f")


def gap1(entry: dict) -> str:
    return signed(entry["logprob_gap"], "+.1f")


def recall(entry: dict) -> str:
    return f"{entry['answer_rows_in_shortlist']:.0%}"


def gemma_needles_4k() -> str:
    dense, exact = needle("gemma3-270m", 4096, "dense"), [correct(e) for e in _each("exact top-k", 4096)]
    return (
        f"with dense and exact top-k at {dense['correct']} of {dense['samples']} at 3% and 1%"
        if exact == [correct(dense)] * 2
        else f"with dense at {dense['correct']} of {dense['samples']}, exact top-k {' and '.join(exact)}"
    )


def _each(column: str, length: int, model: str = "gemma3-270m") -> list[dict]:
    return [needle(model, length, column, density) for density in tables().DENSITIES]


# -- RULER: oa eval folders --------------------------------------------------------------------------------------


def grid(folder: str):
    return tables().ruler_grid(folder)


def mean(folder: str, method: str, density: float) -> dict:
    return grid(folder).means[method, density].row


def task(folder: str, method: str, name: str, density: float = 1.0) -> dict:
    return grid(folder).rows(method, name)[density]


def score(folder: str, method: str, name: str, density: float = 1.0) -> str:
    return tables()._ruler_score(task(folder, method, name, density), "g")


def answered(folder: str, method: str, name: str, density: float = 1.0) -> int:
    """Samples answered right on a one-answer task (a sample scores 0 or 100)."""
    row = task(folder, method, name, density)
    return round(row["score"] * row["samples"] / 100)


def gemma_tasks() -> str:
    from oa_core.eval.report import DENSE_FLOOR

    g = grid(GEMMA_8K)
    ran = {task for task, _ in g.dense}
    kind = "niah " if all(task.startswith("niah") for task in ran) else ""
    scores = ", ".join(f"{name} {task(GEMMA_8K, 'dense', name)['score']:g}" for name in g.tasks())
    return (
        f"the {WORDS[len(ran)]} {kind}tasks dense, then the {WORDS[len(g.tasks())]} it scores at least "
        f"{DENSE_FLOOR:g} on ({scores})"
    )


def niah_single_2() -> str:
    pq = [answered(GEMMA_8K, "default", "niah_single_2", d) for d in tables().DENSITIES]
    n = task(GEMMA_8K, "default", "niah_single_2", 0.03)["samples"]
    exact = [answered(GEMMA_8K, "exact top-k", "niah_single_2", d) for d in tables().DENSITIES]
    said = f"{pq[0]} of {n} at 3% and at 1%" if pq[0] == pq[1] else f"{pq[0]} and {pq[1]} of {n} at 3% and 1%"
    return (
        f"at niah_single_2 PQS answers {said} where dense answers {answered(GEMMA_8K, 'dense', 'niah_single_2')} "
        f"(exact top-k {exact[0]} and {exact[1]}"
    )


def niah_single_3() -> str:
    pq = {score(GRID_4K, "default", "niah_single_3", d) for d in tables().DENSITIES}
    pq_said = f"PQS {pq.pop()} at 3% and 1%" if len(pq) == 1 else f"PQS {' and '.join(sorted(pq))} at 3% and 1%"
    qgs = [score(GRID_4K, "QGS", "niah_single_3", d) for d in (0.05, 0.03)]
    return (
        f"niah_single_3, where dense scores {score(GRID_4K, 'dense', 'niah_single_3')}, {pq_said}, and QGS "
        f"{qgs[0]} and {qgs[1]} at 5% and 3%"
    )


def qgs_keeps() -> str:
    """The lowest density down to which QGS's retention, as the table rounds it, stays at least 1; its share at 1%."""
    g = grid(GRID_4K)
    down_to = None
    for density in sorted((d for m, d in g.means if m == "QGS"), reverse=True):
        if round(g.means["QGS", density].row["retention"], 2) < 1:
            break
        down_to = density
    return f"keeps it down to {down_to:.0%} and {mean(GRID_4K, 'QGS', 0.01)['retention']:.2f} of it at 1%"


def qgs_gap_bound() -> str:
    worst = max(abs(mean(GRID_4K, "QGS", d)["logprob_gap"]) for d in (0.1, 0.05, 0.03))
    return f"stays within {worst:.2f} nats of dense down to 3%"


def grid_cells() -> str:
    from oa_core.eval.records import record_key

    g = grid(GRID_4K)
    complete = all(mean.samples == g.wanted for mean in g.means.values())
    cells = len({record_key(r) for r in g.records})
    cpu = sum(r.get("device") == "cpu" for r in g.records)
    return f"The grid is {'complete' if complete else 'not complete'}: {cells:,} cells, {cpu:,} of them on"


def records_of(name: str) -> list[dict]:
    lines = (RESULTS / GRID_4K / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def cpu_seconds() -> str:
    cpu = [r for r in grid(GRID_4K).records if r.get("device") == "cpu"]
    return f"(prefill and decoding {statistics.mean(r['prefill_s'] + r['generate_s'] for r in cpu):.0f} s a cell"


def gpu_cells() -> str:
    h200, h100 = records_of("records-h200.jsonl"), records_of("records-h100.jsonl")
    return (
        f"{len(h200)} on an H200 (`records-h200.jsonl`: 14 ranks on one GPU under CUDA MPS, up to "
        f"{max(r['batch'] for r in h200)} samples a batch) and {len(h100)} on an H100 (`records-h100.jsonl`)"
    )


# -- the CUDA check and the attention error ----------------------------------------------------------------------


def minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def cuda_machine() -> str:
    """The GPU the CUDA check's ``what`` names."""
    machine = re.search(r"on an? (H\d+) \(", result(CUDA_CHECK)["what"])
    assert machine, result(CUDA_CHECK)["what"]
    return machine[1]


def cuda_check() -> str:
    check = result(CUDA_CHECK)
    cuda, cpu = check["cuda_versions"], check["cpu_versions"]
    differ = [spec for spec, count in check["different_scores_by_spec"].items() if count]
    who = "the vAttention-like spec's" if differ == ["vattention"] else listing(differ)
    return (
        f"{check['cells']} cells run on an {cuda_machine()} (CUDA, torch {minor(cuda['torch'])}, transformers "
        f"{minor(cuda['transformers'])}) beside this grid's CPU records (torch {minor(cpu['torch'])}, transformers "
        f"{minor(cpu['transformers'])}) had the same prompts, token for token, in {check['same_prompt_tokens']} of "
        f"{check['cells']}, the same score in {check['same_score']} and the same output in {check['same_output']}; "
        f"the scores that differ are all {who}"
    )


def cuda_check_made_by() -> str:
    what = result(CUDA_CHECK)["what"]
    commit = re.search(r"commit ([0-9a-f]{7})", what)
    assert commit, what
    return f"names its machine and commit in its `what`: an {cuda_machine()}, {commit[1]}"


def below(name: str, method: str, other: str) -> list[float]:
    """The densities at which ``method``'s mean attention error is below ``other``'s in the result ``name``."""
    per = result(name)["results"]
    return [float(d) for d in per if per[d][method]["mean_error"] < per[d][other]["mean_error"]]


def on_every_text(method: str, other: str) -> list[float]:
    files = [name for _, name, _ in tables().ATTENTION_ERROR]
    return [d for d in below(files[0], method, other) if all(d in below(name, method, other) for name in files)]


def selector_of(name: str, method: str) -> str:
    return {"qgs": "QGS's", "pq": "PQS's"}[result(name)["specs"][method]["selector"]["name"]]


def key_rank() -> str:
    texts = WORDS[len(tables().ATTENTION_ERROR)]
    densities = percents(on_every_text("openattention-qgs", "openattention-query-basis"))
    return f"It lowers the attention error at {densities} on all {texts} texts of `attention_error*.json`"


def second_order() -> str:
    ablations = percents(below("ablations.json", "openattention", "ablate-tail-mean-proxy"))
    texts = percents(on_every_text("openattention", "openattention-mean-proxy"))
    return (
        f"below the mean proxy's at {ablations} with {selector_of('ablations.json', 'openattention')} selection, "
        f"the default then (`ablations.json`), and at {texts} on all "
        f"{WORDS[len(tables().ATTENTION_ERROR)]} texts with "
        f"{selector_of('attention_error.json', 'openattention')} (`attention_error*.json`)"
    )


@dataclass(frozen=True)
class Figure:
    page: str
    text: str  # as the page has it (white space aside)
    made: Callable[[], str]  # the same text from the results


EVALUATION, DESIGN, RESULTS_PAGE = "docs/evaluation.md", "docs/design.md", "docs/results.md"
G = "gemma3-270m"
FIGURES = [
    # docs/evaluation.md, accuracy on both offline models
    Figure(
        EVALUATION,
        "dense 58.9 on its seven tasks",
        lambda: f"dense {grid(GRID_4K).dense_mean():.1f} on its {WORDS[len(grid(GRID_4K).tasks())]} tasks",
    ),
    Figure(
        EVALUATION,
        "`ruler_c3f5e3b_smollm2_8k/` (dense 44.2 on",
        lambda: f"`{GRID_8K}/` (dense {grid(GRID_8K).dense_mean():.1f} on",
    ),
    Figure(
        EVALUATION,
        "the eight niah tasks dense, then the three it scores at least 20 on (niah_single_1 55, niah_single_2 75, "
        "niah_multikey_1 35)",
        gemma_tasks,
    ),
    Figure(
        EVALUATION,
        "PQS against exact top-k: +0.10 / +0.12 and −0.40 / −0.61 nats; QGS −1.18 / −5.80",
        lambda: "PQS against exact top-k: {} and {} nats; QGS {}".format(
            *(
                " / ".join(signed(mean(GEMMA_8K, method, d)["logprob_gap"]) for d in tables().DENSITIES)
                for method in ("default", "exact top-k", "QGS")
            )
        ),
    ),
    Figure(
        EVALUATION,
        "SmolLM2 at 8K answers 2 of 20 even dense",
        lambda: "SmolLM2 at 8K answers {correct} of {samples} even dense".format(
            **needle("smollm2-135m", 8192, "dense")
        ),
    ),
    Figure(
        EVALUATION,
        "Gemma's recall was measured on layers 5, 5 and 11",
        lambda: f"Gemma's recall was measured on layers {listing(result(f'retrieval_{G}.json')['recall_layers'])}",
    ),
    Figure(
        EVALUATION,
        "at niah_single_2 PQS answers 20 of 20 at 3% and at 1% where dense answers 15 (exact top-k 19 and 18",
        niah_single_2,
    ),
    # docs/evaluation.md, the 4K grid
    Figure(EVALUATION, "The grid is complete: 2,740 cells, 2,044 of them on", grid_cells),
    Figure(EVALUATION, "(prefill and decoding 34 s a cell", cpu_seconds),
    Figure(
        EVALUATION,
        "515 on an H200 (`records-h200.jsonl`: 14 ranks on one GPU under CUDA MPS, up to 8 samples a batch) and 181 "
        "on an H100 (`records-h100.jsonl`)",
        gpu_cells,
    ),
    Figure(
        EVALUATION,
        "(retention 1.10 and 1.08, log-likelihood gaps −0.02 and +0.14 nats)",
        lambda: "(retention {} and {}, log-likelihood gaps {} and {} nats)".format(
            *(f"{mean(GRID_4K, 'default', d)['retention']:.2f}" for d in tables().DENSITIES),
            *(signed(mean(GRID_4K, "default", d)["logprob_gap"]) for d in tables().DENSITIES),
        ),
    ),
    Figure(EVALUATION, "keeps it down to 3% and 0.83 of it at 1%", qgs_keeps),
    Figure(
        EVALUATION,
        "niah_single_3, where dense scores 30 (15–52), PQS 45 (26–66) at 3% and 1%, and QGS 45 (26–66) and 50 "
        "(30–70) at 5% and 3%",
        niah_single_3,
    ),
    Figure(EVALUATION, "stays within 0.15 nats of dense down to 3%", qgs_gap_bound),
    Figure(
        EVALUATION,
        "(its gap there −0.37 nats, QGS's −0.15) and falls to 0.45 at 1%",
        lambda: "(its gap there {} nats, QGS's {}) and falls to {:.2f} at 1%".format(
            signed(mean(GRID_4K, "vAttention-like", 0.03)["logprob_gap"]),
            signed(mean(GRID_4K, "QGS", 0.03)["logprob_gap"]),
            mean(GRID_4K, "vAttention-like", 0.01)["retention"],
        ),
    ),
    Figure(
        EVALUATION,
        "its gap from −1.22 nats at 10% to −5.05 at 1%",
        lambda: "its gap from {} nats at 10% to {} at 1%".format(
            *(signed(mean(GRID_4K, "exact top-k", d)["logprob_gap"]) for d in (0.1, 0.01))
        ),
    ),
    Figure(
        EVALUATION,
        "keeps 0.49 of dense at 10% and 0.00 at 1%",
        lambda: "keeps {:.2f} of dense at 10% and {:.2f} at 1%".format(
            *(mean(GRID_4K, "Quest-like", d)["retention"] for d in (0.1, 0.01))
        ),
    ),
    Figure(
        EVALUATION,
        "150 cells run on an H200 (CUDA, torch 2.11, transformers 5.24) beside this grid's CPU records (torch 2.13, "
        "transformers 5.25) had the same prompts, token for token, in 150 of 150, the same score in 145 and the same "
        "output in 129; the scores that differ are all the vAttention-like spec's",
        cuda_check,
    ),
    # docs/design.md, step 3: why PQS is the default (Gemma's needles)
    Figure(DESIGN, "with dense and exact top-k at 11 of 20 at 3% and 1%", gemma_needles_4k),
    Figure(
        DESIGN,
        "the default with QGS 5 and 2 of 20 (answer log-likelihood gaps to dense −17.8 and −28.0 nats), its "
        "shortlists holding 75% and 81% of exact top-k's rows for the answer",
        lambda: (
            f"the default with QGS {pair(G, 4096, 'QGS', correct)} of 20 (answer log-likelihood gaps to dense "
            f"{pair(G, 4096, 'QGS', gap1)} nats), its shortlists holding {pair(G, 4096, 'QGS', recall)} of exact "
            "top-k's rows for the answer"
        ),
    ),
    Figure(
        DESIGN,
        "with PQS 11 and 11 of 20 (+0.02 and +0.14 nats), 97% and 93% of the rows",
        lambda: (
            f"with PQS {pair(G, 4096, 'default', correct)} of 20 ({pair(G, 4096, 'default', gap)} nats), "
            f"{pair(G, 4096, 'default', recall)} of the rows"
        ),
    ),
    Figure(
        DESIGN,
        "At 8K (dense 9 of 20, exact top-k 9 and 8)",
        lambda: (
            f"At 8K (dense {needle(G, 8192, 'dense')['correct']} of 20, "
            f"exact top-k {pair(G, 8192, 'exact top-k', correct)})"
        ),
    ),
    Figure(
        DESIGN,
        "the default with QGS 2 and 1 (−23.1 and −31.8 nats, 74% and 75% of the rows)",
        lambda: (
            f"the default with QGS {pair(G, 8192, 'QGS', correct)} ({pair(G, 8192, 'QGS', gap1)} nats, "
            f"{pair(G, 8192, 'QGS', recall)} of the rows)"
        ),
    ),
    Figure(
        DESIGN,
        "with PQS 10 and 9 (−0.02 and −0.02 nats; exact top-k's −0.03 and +0.02), 97% and 95% of the rows",
        lambda: (
            f"with PQS {pair(G, 8192, 'default', correct)} ({pair(G, 8192, 'default', gap)} nats; exact top-k's "
            f"{pair(G, 8192, 'exact top-k', gap)}), {pair(G, 8192, 'default', recall)} of the rows"
        ),
    ),
    # docs/design.md, steps 6 and 7: the key spread and the bounded second-order proxy (attention error)
    Figure(
        DESIGN, "It lowers the attention error at 5%, 3% and 1% on all three texts of `attention_error*.json`", key_rank
    ),
    Figure(
        DESIGN,
        "below the mean proxy's at 10%, 5%, 3% and 1% with QGS's selection, the default then (`ablations.json`), and "
        "at 5%, 3% and 1% on all three texts with PQS's (`attention_error*.json`)",
        second_order,
    ),
    # docs/results.md
    Figure(RESULTS_PAGE, "names its machine and commit in its `what`: an H200, a7928ec", cuda_check_made_by),
    Figure(
        RESULTS_PAGE,
        "150 cells of the 4K grid run again on an H200",
        lambda: f"{result(CUDA_CHECK)['cells']} cells of the 4K grid run again on an {cuda_machine()}",
    ),
]


@pytest.mark.parametrize("figure", FIGURES, ids=[f"{f.page}: {f.text[:50]}" for f in FIGURES])
def test_a_quoted_figure_is_on_its_page_and_follows_from_its_result(figure):
    assert figure.text in page(figure.page), f"{figure.page} no longer says: {figure.text}"
    made = figure.made()
    assert made == figure.text, f"{figure.page} says\n  {figure.text}\nbut its result gives\n  {made}"


def test_a_needle_method_is_found_by_the_spec_it_ran():
    """The retrieval results name PQS `ablate-selector-pq` and QGS `openattention` (the names of their day): the
    columns come from what each ran."""
    methods = tables().needle_methods(result(f"retrieval_{G}.json"))
    assert methods["default", 0.03] == "ablate-selector-pq 3%"
    assert methods["QGS", 0.01] == "openattention 1%"


def test_a_grid_method_is_found_by_the_spec_it_ran():
    names = grid(GRID_4K).names
    assert names["ablate-selector-pq"] == "default"
    assert names["openattention"] == "QGS"
    assert names["vattention"] == "vAttention-like" and names["quest"] == "Quest-like"
