"""The shape of the package, read from the source: what imports what (ast, every import that runs, those inside
functions included), and how long each module is.

- No import cycle among the modules of ``oa_core`` and ``oa_plugins``.
- ``oa_core`` imports no plugin: built-in components reach the core the way third-party ones do.
- No module imports another module's private (underscored) name.
- No module is over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"oa_core": ROOT / "oa_core", "oa_plugins": ROOT / "plugins"}
LONGEST = 500


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
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in known:  # `from package import module`
                    found.append((f"{base}.{alias.name}", None))
                else:
                    found.append((base, alias.name))
    return [(module, taken) for module, taken in found if module in known]


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only: never imported when the code runs)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


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


def test_no_import_cycle():
    _, edges = graph()
    assert cycles(edges) == []


def test_the_core_imports_no_plugin():
    _, edges = graph()
    offending = {name: sorted({m for m, _ in targets if m.startswith("oa_plugins")})
                 for name, targets in edges.items() if name.startswith("oa_core")}
    assert {name: targets for name, targets in offending.items() if targets} == {}


def test_no_module_takes_another_modules_private_name():
    _, edges = graph()
    private = sorted((name, f"{module}.{taken}") for name, targets in edges.items() for module, taken in targets
                     if taken is not None and taken.startswith("_") and module != name)
    assert private == []


def test_no_module_is_over_500_lines():
    known, _ = graph()
    long = {name: n for name, path in known.items() if (n := len(path.read_text().splitlines())) > LONGEST}
    assert long == {}
