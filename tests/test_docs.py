"""The documentation site: it builds with ``mkdocs build --strict`` (no broken link, anchor or API reference), its
generated tables match the code, and its API reference names every public name of ``oa_core``."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import oa_core
from oa_core import docs_tables

ROOT = Path(__file__).resolve().parents[1]
DOCS_TOOLS = {
    "mkdocs": "mkdocs",
    "material": "mkdocs-material",
    "mkdocstrings": "mkdocstrings",
    "mkdocstrings_handlers.python": "mkdocstrings[python]",
}


def _missing_docs_tools() -> list[str]:
    missing = []
    for module, package in DOCS_TOOLS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package of a dotted name is absent
            found = False
        if not found:
            missing.append(package)
    return missing


def test_the_site_builds_strictly(tmp_path):
    missing = _missing_docs_tools()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install -e '.[dev]' installs the docs tools")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "components" / "index.html").is_file()


def test_the_generated_tables_match_the_code():
    page = docs_tables.PAGE.read_text()
    assert page == docs_tables.rendered(page), (
        f"{docs_tables.PAGE.relative_to(ROOT)} is stale: its generated tables differ from the components' pydantic "
        f"models or from specs/; run: {docs_tables.COMMAND}"
    )


def test_the_api_reference_names_every_public_name():
    documented = set(
        re.findall(r"^::: oa_core\.(?:components\.)?(\w+)\s*$", (ROOT / "docs" / "api.md").read_text(), re.MULTILINE)
    )
    assert set(oa_core.__all__) <= documented, (
        f"docs/api.md lacks a '::: oa_core.NAME' entry for {sorted(set(oa_core.__all__) - documented)}"
    )


def test_replace_block_rewrites_only_between_its_markers():
    text = "before\n<!-- params:begin -->\nold\n<!-- params:end -->\nafter\n"
    assert docs_tables.replace_block(text, "params", "new\n") == (
        "before\n<!-- params:begin -->\nnew\n<!-- params:end -->\nafter\n"
    )
    with pytest.raises(ValueError, match="params:begin"):
        docs_tables.replace_block("no markers\n", "params", "new")


def test_a_parameter_row_says_type_default_constraint_and_description():
    from typing import Literal

    from pydantic import BaseModel, Field

    class Example(BaseModel):
        bits: Literal[4, 8] = Field(default=4, description="bits per code | a pipe")
        rank: int | None = Field(default=None, ge=1, le=62)

    rows = docs_tables.parameter_table(Example).splitlines()[2:]
    assert rows == [
        "| `bits` | `int` | `4` | one of `4`, `8` | bits per code \\| a pipe |",
        "| `rank` | `int` or `null` | `null` | ≥ 1, ≤ 62 |  |",
    ]


def test_every_field_of_the_spec_and_the_components_configs_is_described():
    """The parameters tables have no empty description cell: each field says what it does."""
    from oa_core.registry import default_registry
    from oa_core.spec import Budget, ComponentSpec, PipelineSpec

    registry = default_registry()
    configs = [
        registry.components[kind][name].cls.Config for kind in registry.components for name in registry.names(kind)
    ]
    silent = sorted(
        f"{model.__module__}.{model.__qualname__}.{field}"
        for model in (PipelineSpec, Budget, ComponentSpec, *configs)
        for field, info in model.model_fields.items()
        if not info.description
    )
    assert silent == []


# A repository path under benchmarks/ as the pages write it: `benchmarks/results/demo.json`, `../benchmarks/studies/`.
BENCHMARK_PATH = re.compile(r"benchmarks/[\w./-]*")


def test_every_benchmarks_path_the_readme_and_the_pages_name_exists():
    """A result or a script cited for a figure or a claim is there: a result moved to the studies or deleted (git
    keeps it) leaves no path behind."""
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in BENCHMARK_PATH.findall(page.read_text(encoding="utf-8")):
            path = path.rstrip(".,:;")
            if "..." not in path and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "no such path:\n" + "\n".join(missing)


def test_the_studies_index_names_every_study_and_only_files_that_exist():
    studies = ROOT / "benchmarks" / "studies"
    index = (studies / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([\w.-]+(?:\.py|\.jsonl?|/))`", index))
    scripts = {path.name for path in studies.glob("*.py")}
    assert scripts <= named, f"not in benchmarks/studies/README.md: {sorted(scripts - named)}"
    missing = [name for name in named if not ((studies / name).exists() or (studies / "results" / name).exists())]
    assert not missing, f"benchmarks/studies/README.md names what is not there: {missing}"
