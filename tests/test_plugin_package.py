"""A third-party plugin package, installed for real: examples/oa-plugin-example in a temporary virtual environment
(with this environment's packages visible), then uninstalled."""

import textwrap
from pathlib import Path

import pytest

from venvs import listed, make_venv, pip, run

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "oa-plugin-example"
COMPONENTS = {("clusterer", "random"), ("selector", "key-norm"), ("allocator", "proportional"), ("kernel", "float64")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    return make_venv(tmp_path_factory.mktemp("venv"))


def test_pip_install_adds_the_components_and_uninstall_removes_them(venv, tmp_path):
    if any(package == "oa-plugin-example" for *_, package in listed(venv)):
        pytest.skip("oa-plugin-example is already installed in the base environment")

    install = pip(venv, "install", "--no-deps", "--no-build-isolation", "--no-index", str(EXAMPLE))
    assert install.returncode == 0, install.stdout + install.stderr
    assert {(kind, name, "oa-plugin-example") for kind, name in COMPONENTS} <= listed(venv)

    # A YAML spec naming the new components builds and runs, next to the built-ins.
    spec = tmp_path / "example.yaml"
    spec.write_text(
        textwrap.dedent("""
        clusterer: {name: random, num_clusters: 8}
        selector: key-norm
        allocator: proportional
        kernel: float64
        budget: {density: 0.2}
        sink: 4
        local: 16
    """)
    )
    script = textwrap.dedent(f"""
        import torch, oa_core as oa
        pipe = oa.build({str(spec)!r})
        gen = torch.Generator().manual_seed(0)
        keys, values = torch.randn(2, 2, 200, 32, generator=gen), torch.randn(2, 2, 200, 32, generator=gen)
        state = pipe.prepare(keys, values, torch.randn(2, 6, 16, 32, generator=gen))
        out, stats = pipe.attend(torch.randn(2, 6, 1, 32, generator=gen), state, return_stats=True)
        print(repr(pipe)); print(stats.reason, round(stats.density, 3), bool(torch.isfinite(out).all()))
    """)
    used = run(venv, "-c", script)
    assert used.returncode == 0, used.stderr
    assert "RandomClusterer" in used.stdout and "Float64Kernel" in used.stdout
    assert "sparse: proxy tail 0.2 True" in used.stdout

    # The package's own tests (the conformance kit included) pass where it is installed.
    tests = run(venv, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests"), cwd=tmp_path)
    assert tests.returncode == 0, tests.stdout + tests.stderr

    uninstall = pip(venv, "uninstall", "-y", "oa-plugin-example")
    assert uninstall.returncode == 0, uninstall.stderr
    after = listed(venv)
    assert not any(package == "oa-plugin-example" for *_, package in after)
    assert ("selector", "qgs", "openattention") in after
