import subprocess
import sys
from pathlib import Path

SPECS = sorted(str(p) for p in (Path(__file__).parents[1] / "specs").glob("*.yaml"))


def oa(*args):
    return subprocess.run([sys.executable, "-m", "oa_core.cli", *args], capture_output=True, text=True)


def test_validate_accepts_every_shipped_spec():
    assert SPECS
    result = oa("validate", *SPECS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok: Pipeline(") == len(SPECS)


def test_validate_rejects_a_bad_spec_with_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("budget: {density: 2}\n")
    result = oa("validate", SPECS[0], str(bad))
    assert result.returncode == 1
    assert "invalid: budget.density: Input should be less than or equal to 1" in result.stdout
    assert ": ok: " in result.stdout  # the good one is still reported


def test_console_script_is_installed():
    result = subprocess.run(["oa", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "plugins" in result.stdout and "validate" in result.stdout
