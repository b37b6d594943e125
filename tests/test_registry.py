import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

import oa_core as oa
from oa_core.registry import Registry

BUILT_INS = {
    "clusterer": ["qgc"],
    "selector": ["oracle", "qgs"],
    "allocator": ["errorgate", "global"],
    "kernel": ["torch"],
}


def test_built_ins_come_from_the_installed_entry_point_group():
    names = {ep.name for ep in entry_points(group="openattention")}
    assert {"qgc", "qgs", "oracle", "errorgate", "global", "torch"} <= names
    available = oa.available()
    for kind, built_in in BUILT_INS.items():
        assert set(built_in) <= set(available[kind])
    registry = Registry()
    registry.load_entry_points()
    assert registry.get("selector", "qgs").package == "openattention"
    assert not registry.failures


@pytest.fixture
def broken_plugins(tmp_path):
    """Two installed-looking distributions on a path: one whose module fails to import, one that re-registers qgc."""
    (tmp_path / "oa_broken_import.py").write_text("raise ImportError('missing dependency: fancylib')\n")
    (tmp_path / "oa_duplicate.py").write_text(
        textwrap.dedent("""
        from oa_core import hookimpl
        from oa_core.components import Clusterer

        class Impostor(Clusterer):
            '''Claims a built-in name.'''
            name = "qgc"

        @hookimpl
        def register_clusterers(register):
            register(Impostor)
    """)
    )
    for dist, module in (("oa_broken_import", "oa_broken_import"), ("oa_duplicate", "oa_duplicate")):
        info = tmp_path / f"{dist}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[openattention]\n{module} = {module}\n")
    return tmp_path


def test_broken_plugins_are_reported_by_name_and_the_rest_still_load(broken_plugins, monkeypatch):
    monkeypatch.syspath_prepend(str(broken_plugins))
    registry = Registry()
    with pytest.warns(RuntimeWarning):
        registry.load_entry_points()
    failures = {f.plugin: str(f) for f in registry.failures}
    assert "missing dependency: fancylib" in failures["oa_broken_import"]
    assert "package 'oa_broken_import'" in failures["oa_broken_import"]
    assert "'qgc' is already registered by package 'openattention'" in failures["oa_duplicate"]
    assert registry.get("clusterer", "qgc").package == "openattention"
    for kind, built_in in BUILT_INS.items():
        assert set(built_in) <= set(registry.names(kind))


def test_oa_plugins_lists_components_and_reports_failures(broken_plugins):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(broken_plugins), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "oa_core.cli", "plugins"], capture_output=True, text=True, env=env)
    assert result.returncode == 0
    for kind, built_in in BUILT_INS.items():
        for name in built_in:
            assert any(line.split()[:3] == [kind, name, "openattention"] for line in result.stdout.splitlines())
    assert "oa_broken_import" in result.stderr and "fancylib" in result.stderr
    assert "oa_duplicate" in result.stderr


def test_registering_a_non_component_is_reported():
    registry = Registry()
    with pytest.warns(RuntimeWarning):
        registry.add("selector", dict, plugin="bad", package="bad-pkg")
    assert "not a Selector subclass" in str(registry.failures[0])
    assert registry.names("selector") == []


def test_a_component_without_a_name_or_with_a_bad_config_is_reported():
    from oa_core.components import Clusterer

    class Nameless(Clusterer):
        pass

    class BadConfig(Clusterer):
        name = "bad-config"
        Config = dict

    registry = Registry()
    with pytest.warns(RuntimeWarning):
        registry.add("clusterer", Nameless, plugin="p", package="pkg-a")
        registry.add("clusterer", BadConfig, plugin="q", package="pkg-b")
    messages = [str(f) for f in registry.failures]
    assert "plugin 'p' from package 'pkg-a': Nameless needs a non-empty string class attribute `name`" in messages[0]
    assert "package 'pkg-b': clusterer 'bad-config': Config must be a pydantic BaseModel subclass" in messages[1]
    assert registry.names("clusterer") == []


def test_an_invalid_parameter_names_the_field_and_the_package():
    with pytest.raises(
        oa.SpecError,
        match=r"clusterer.num_clusters: .* \(clusterer 'qgc' from package "
        r"'openattention'\)",
    ):
        oa.build({"clusterer": {"name": "qgc", "num_clusters": 0}})
