"""The module paths of 0.1's flat layout, importable for one more release: ``import oa_core.selection`` gives
``oa_core.ops.selection`` itself, with a DeprecationWarning that names the new path. Nothing in this project uses
them (``tests/test_architecture.py``)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {
    **{
        f"oa_core.{name}": f"oa_core.ops.{name}"
        for name in (
            "cluster_stats",
            "dense_decode",
            "geometry",
            "kmeans",
            "native",
            "rerank",
            "scatter",
            "selection",
            "triton_path",
            "water_filling",
        )
    },
    **{f"oa_core.{name}": f"oa_core.analysis.{name}" for name in ("attention_error", "demo", "metrics", "needle")},
    "oa_core.offline_model": "oa_core.analysis.offline_model",
    "oa_core.references": "oa_core.testing.references",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at the new one (the same object, so its state is shared)."""

    def __init__(self) -> None:
        self.specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(self, fullname, path=None, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path will be removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self.specs[new] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the old path's spec on the module: give it back its own
        module.__spec__ = self.specs[module.__name__]


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
