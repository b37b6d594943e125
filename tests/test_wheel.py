"""The package as a user gets it from an index: ``python -m build`` makes the wheel; it holds every module of the
source tree and the ``py.typed`` markers; installed in a clean virtual environment, its ``oa`` command lists the
built-in components, imported from the wheel and not from this checkout."""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from venvs import make_venv, pip, run

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"oa_core": ROOT / "oa_core", "oa_plugins": ROOT / "plugins"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason="python -m build is absent: the dev extra installs it")
    # from a copy of what the package is made of: a build in the checkout would reuse its build/ and *.egg-info
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "README.md", "LICENSE", "oa_core", "plugins"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    built = run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(source))
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (found,) = out.glob("openattention-*.whl")
    return found


def test_the_wheel_holds_every_module_and_the_type_markers(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"{package}/{path.relative_to(folder).as_posix()}"
        for package, folder in SOURCES.items()
        for path in [*folder.rglob("*.py"), folder / "py.typed"]
    }
    assert sorted(expected - names) == []
    assert any(name.endswith("entry_points.txt") for name in names)


def test_the_installed_wheel_lists_the_built_in_components(wheel, tmp_path):
    python = make_venv(tmp_path / "venv")
    install = pip(python, "install", "--no-deps", "--no-index", str(wheel))
    assert install.returncode == 0, install.stdout + install.stderr

    where = run(
        python, "-c", "import oa_core, oa_plugins; print(oa_core.__file__); print(oa_plugins.__file__)", cwd=tmp_path
    )  # not this checkout's folder, which -c would put first on the path
    assert where.returncode == 0, where.stderr
    assert all(Path(line).is_relative_to(tmp_path / "venv") for line in where.stdout.split()), where.stdout

    listing = run(python.parent / "oa", "plugins", cwd=tmp_path)  # the console script the wheel installs
    assert listing.returncode == 0, listing.stderr
    rows = {tuple(line.split()[:3]) for line in listing.stdout.splitlines()[1:] if line.strip()}
    for kind, name in (("clusterer", "qgc"), ("selector", "pq"), ("allocator", "errorgate"), ("kernel", "flash")):
        assert (kind, name, "openattention") in rows
