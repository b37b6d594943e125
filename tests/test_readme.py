"""The README as a newcomer reads it: short, its pipeline snippet runs and prints what the README shows, and its
results tables are the ones benchmarks/results renders (benchmarks/results_tables.py)."""

import contextlib
import io
import re
from pathlib import Path

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 250


def test_the_pipeline_snippet_prints_what_the_readme_shows():
    """The first Python block is the pipeline on random tensors; the plain block after it is its output."""
    match = re.search(r"```python\n(?P<code>.*?)```\n\n```\n(?P<output>.*?)```", README, re.S)
    assert match, "the README's first Python block should be followed by its output"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(match["code"], "README.md", "exec"), {})  # the README's own snippet
    assert printed.getvalue() == match["output"]


def test_the_results_tables_are_rendered_from_the_results():
    tables = load_benchmark("results_tables")
    assert tables.main(["--check"]) == 0, "python benchmarks/results_tables.py --write"
