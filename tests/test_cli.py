import subprocess
import sys
from pathlib import Path

import pytest

from oa_core import SpecError

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


def test_the_eval_defaults_pass_their_own_budget_check(monkeypatch):
    """`oa eval` with no option must not refuse itself: its default densities and length give every shipped spec a
    budget of at least its sink + local (the check that runs before the model loads); the library's defaults agree."""
    from oa_core import cli
    from oa_core.eval import runner

    monkeypatch.chdir(Path(__file__).parents[1])  # default_specs: ./specs
    args = cli.build_parser().parse_args(["eval"])
    config = runner.EvalConfig(specs=cli.default_specs(), densities=args.densities, lengths=args.length)
    assert config.specs and args.densities == runner.EvalConfig(specs=[]).densities
    runner.check_budgets(runner.resolved_specs(config), config)  # raises SpecError on a budget too small
    low = runner.EvalConfig(specs=config.specs, densities=[0.01], lengths=args.length)  # the case the help names
    with pytest.raises(SpecError, match=r"fewer than its sink \+ local = 4 \+ 64"):
        runner.check_budgets(runner.resolved_specs(low), low)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--density", "2"], "budget.density: Input should be less than or equal to 1"),
        (
            ["--density", "0.01"],
            "density: 0.01 of 3000 tokens reads 30 rows, fewer than sink + local = 68: it would run "
            "dense; pass --tokens 6800 or more",
        ),
        (["--tokens", "100"], "tokens: expected 200 to "),
    ],
)
def test_demo_refuses_bad_arguments_before_the_model_loads(monkeypatch, capsys, args, message):
    from oa_core import cli
    from oa_core.analysis import demo

    monkeypatch.setattr(demo, "load_offline_model", lambda *_, **__: pytest.fail("the model loaded"))
    assert cli.main(["demo", *args]) == 2
    assert f"oa demo: {message}" in capsys.readouterr().err


def test_help_shows_the_defaults():
    from oa_core import cli

    text = cli.build_parser()._subparsers._group_actions[0].choices["eval"].format_help()
    flat = " ".join(text.split())
    assert "samples per task and length (default: 20)" in flat and "(default: 0.1 0.05 0.03)" in flat
    assert "seed of the RULER samples (default: 0)" in flat
