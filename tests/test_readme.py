"""The README as a newcomer reads it: short, its pipeline snippet runs and prints what the README shows, and its
results tables are the ones benchmarks/results renders (benchmarks/results_tables.py)."""

import contextlib
import io
import re
from pathlib import Path

import pytest

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


def test_a_block_whose_markers_are_missing_or_twice_is_named():
    tables = load_benchmark("results_tables")
    assert (
        tables.render("a\n<!-- results:speed -->\nold\n<!-- /results:speed -->\nb", {"speed": "new"})
        == "a\n<!-- results:speed -->\nnew\n<!-- /results:speed -->\nb"
    )
    with pytest.raises(SystemExit, match=r"the block 'speed' must appear once.*found 0"):
        tables.render("no markers here", {"speed": "new"})
    twice = "<!-- results:speed -->\n<!-- /results:speed -->\n" * 2
    with pytest.raises(SystemExit, match=r"found 2"):
        tables.render(twice, {"speed": "new"})
