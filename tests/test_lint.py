"""The code passes the linter, the formatter and the type checker, with the settings in pyproject.toml: ``ruff check``
and ``ruff format --check`` over the packages, the tests and the benchmarks ([tool.ruff]), and ``mypy`` over oa_core
and oa_plugins ([tool.mypy])."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _command(tool: str) -> list[str]:
    """How to run ``tool``: as a module of this interpreter where it is installed here (the dev extra), else the
    executable on PATH; the test is skipped when neither is there."""
    if importlib.util.find_spec(tool) is not None:
        return [sys.executable, "-m", tool]
    found = shutil.which(tool)
    if found is None:
        pytest.skip(f"{tool} is not installed (it comes with the dev extra: pip install -e '.[dev]')")
    return [found]


def _passes(command: list[str], timeout: int) -> None:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"`{' '.join(command)}` exited with {done.returncode}:\n{done.stdout}{done.stderr}"


def test_ruff_finds_nothing():
    _passes([*_command("ruff"), "check", "oa_core", "plugins", "tests", "benchmarks"], timeout=300)


def test_ruff_format_changes_nothing():
    _passes([*_command("ruff"), "format", "--check", "oa_core", "plugins", "tests", "benchmarks"], timeout=300)


def test_mypy_finds_nothing():
    # This interpreter's packages (torch, pydantic, transformers) give mypy their types, also when mypy itself comes
    # from PATH. The first run reads torch's annotations (a minute or two); .mypy_cache makes later ones quick.
    _passes([*_command("mypy"), "--python-executable", sys.executable], timeout=900)
