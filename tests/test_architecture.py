"""The shape of the package, read from the source: what imports what (ast, every import, those inside functions and
under ``if TYPE_CHECKING:`` included), and how long each module is.

- ``oa_core`` stands in layers, each importing only from itself and those below it (``LAYERS``).
- No import cycle among the modules of ``oa_core`` and ``oa_plugins``, not even for a type.
- ``oa_core`` imports no plugin: built-in components reach the core the way third-party ones do.
- No module imports another module's private (underscored) name.
- No module is over 500 lines.
- Nothing in the project imports 0.1's flat module paths (``oa_core/moved.py``), which still load, with a warning.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"oa_core": ROOT / "oa_core", "oa_plugins": ROOT / "plugins"}
LONGEST = 500
LAYERS = [  # bottom first; a module belongs to the longest prefix that names it
    ("types", ["oa_core.spec", "oa_core.components", "oa_core.hookspecs"]),
    ("ops", ["oa_core.ops"]),
    (
        "core",
        [
            "oa_core.registry",
            "oa_core.contracts",
            "oa_core.state",
            "oa_core.pipeline",
            "oa_core.static",
            "oa_core.docs_tables",
            "oa_core.moved",
        ],
    ),
    ("integration", ["oa_core.integration"]),
    ("face", ["oa_core"]),  # the package's own names: oa.build, oa.patch, ...
    ("tools", ["oa_core.analysis", "oa_core.testing"]),
    ("eval", ["oa_core.eval"]),
    ("cli", ["oa_core.cli"]),
]


def modules() -> dict[str, Path]:
    """Dotted module name → file, for both import packages."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(imported module, name taken from it or None) for every import of ``name``'s source inside the packages."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in known:  # `from package import module`
                    found.append((f"{base}.{alias.name}", None))
                else:
                    found.append((base, alias.name))
    return [(module, taken) for module, taken in found if module in known]


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, str | None]]]]:
    known = modules()
    return known, {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, list[tuple[str, str | None]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target, _ in edges.get(node, ()):
            if target == node or target not in edges:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layer(name: str) -> int:
    """The index in ``LAYERS`` of a module of ``oa_core``."""
    owners = [
        (len(prefix), i)
        for i, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if name == prefix or (prefix != "oa_core" and name.startswith(prefix + "."))
    ]
    assert owners, f"{name} is in no layer of LAYERS"
    return max(owners)[1]


def test_each_layer_imports_only_itself_and_those_below():
    _, edges = graph()
    upward = sorted(
        (f"{name} ({LAYERS[layer(name)][0]})", f"{target} ({LAYERS[layer(target)][0]})")
        for name, targets in edges.items()
        if name.startswith("oa_core")
        for target, _ in targets
        if target.startswith("oa_core") and layer(target) > layer(name)
    )
    assert upward == []


def test_the_layers_rule_is_not_vacuous():
    _, edges = graph()
    assert {LAYERS[layer(name)][0] for name in edges if name.startswith("oa_core")} == {n for n, _ in LAYERS}
    assert "oa_core.ops.selection" in [t for t, _ in edges["oa_core.pipeline"]]  # the core reads ops from above


def test_no_import_cycle():
    _, edges = graph()
    assert cycles(edges) == []


def test_the_core_imports_no_plugin():
    _, edges = graph()
    offending = {
        name: sorted({m for m, _ in targets if m.startswith("oa_plugins")})
        for name, targets in edges.items()
        if name.startswith("oa_core")
    }
    assert {name: targets for name, targets in offending.items() if targets} == {}


def test_no_module_takes_another_modules_private_name():
    _, edges = graph()
    private = sorted(
        (name, f"{module}.{taken}")
        for name, targets in edges.items()
        for module, taken in targets
        if taken is not None and taken.startswith("_") and module != name
    )
    assert private == []


def test_no_module_is_over_500_lines():
    known, _ = graph()
    long = {name: n for name, path in known.items() if (n := len(path.read_text().splitlines())) > LONGEST}
    assert long == {}


def test_no_file_uses_a_moved_module_path():
    from oa_core.moved import MOVED

    old = re.compile(r"\b(" + "|".join(re.escape(name) for name in MOVED) + r")\b")
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.yml", "*.toml"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    using = sorted(
        path
        for path in tracked
        if path not in {"oa_core/moved.py", "tests/test_architecture.py"}
        and (ROOT / path).exists()
        and old.search((ROOT / path).read_text())
    )
    assert using == []


def test_a_moved_path_loads_the_new_module_with_a_warning():
    import importlib
    import sys

    import oa_core  # noqa: F401  (installs the finder)
    from oa_core.ops import selection

    sys.modules.pop("oa_core.selection", None)
    with pytest.warns(DeprecationWarning, match="oa_core.selection moved to oa_core.ops.selection"):
        old = importlib.import_module("oa_core.selection")
    assert old is selection
    assert selection.__spec__.name == "oa_core.ops.selection"  # the module keeps its own spec
