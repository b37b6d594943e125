"""Nested virtual environments for the tests that install packages for real (the plugin example, the wheel)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path


def run(program: Path | str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a program of (or under) a nested environment, without this process's PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    return subprocess.run(
        [str(program), *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def make_venv(path: Path) -> Path:
    """A virtual environment at ``path`` that sees this one's packages (torch, openattention) and has no pip of its
    own; returns its python. Install with ``pip`` below: pip runs from here with --python, so a build uses this
    environment's setuptools (offline, no build isolation). Its own site folder comes first on its path, so what is
    installed there shadows this environment's copy. ``--system-site-packages`` alone shows the base interpreter's
    packages, not a virtual environment's this one may be: a ``.pth`` line adds this environment's site folders
    (their own ``.pth`` files, editable installs', run)."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True, timeout=300
    )
    python = path / "bin" / "python"
    inner = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    folders = [folder for folder in site.getsitepackages() if Path(folder).is_dir()]
    (Path(inner) / "outer-environment.pth").write_text(f"import site; list(map(site.addsitedir, {folders!r}))\n")
    return python


def pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    """This environment's pip, acting on the nested one."""
    return run(Path(sys.executable), "-m", "pip", "--python", str(python), *args)


def listed(python: Path) -> set[tuple[str, str, str]]:
    """(kind, name, package) of every component ``oa plugins`` lists under that python."""
    result = run(python, "-m", "oa_core.cli", "plugins")
    assert result.returncode == 0, result.stderr
    return {tuple(line.split()[:3]) for line in result.stdout.splitlines()[1:] if line.strip()}
