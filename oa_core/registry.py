"""Discovery: every module named in the ``openattention`` entry-point group is loaded into one pluggy manager.

Built-in components (``oa_plugins``) come in through the same group as third-party packages. Each module is
loaded and each hook implementation called on its own, so one broken plugin is reported by name and the others
still load.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points

import pluggy
from pydantic import BaseModel

from oa_core import hookspecs
from oa_core.components import KINDS, Component

ENTRY_POINT_GROUP = hookspecs.PROJECT
BUILT_IN = "openattention"  # the distribution that ships oa_core and oa_plugins


@dataclass(frozen=True)
class ComponentInfo:
    kind: str
    name: str
    cls: type[Component]
    plugin: str  # entry-point name
    package: str  # distribution that ships it

    @property
    def doc(self) -> str:
        return (self.cls.__doc__ or "").strip().splitlines()[0] if self.cls.__doc__ else ""


@dataclass(frozen=True)
class PluginFailure:
    plugin: str
    package: str
    error: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} from package {self.package!r}: {self.error}"


class Registry:
    """Registered components by kind and name, plus the plugins that failed to load."""

    def __init__(self) -> None:
        self.components: dict[str, dict[str, ComponentInfo]] = {kind: {} for kind in KINDS}
        self.failures: list[PluginFailure] = []
        self._manager = pluggy.PluginManager(hookspecs.PROJECT)
        self._manager.add_hookspecs(hookspecs)
        self._packages: dict[str, str] = {}

    def load_entry_points(self) -> None:
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            package = ep.dist.name if ep.dist is not None else "?"
            try:
                module = ep.load()
                self._manager.register(module, name=ep.name)
            except Exception as exc:  # a broken plugin must not take the others down
                self._fail(ep.name, package, f"failed to load: {type(exc).__name__}: {exc}")
                continue
            self._packages[ep.name] = package
        for kind in KINDS:
            hook = getattr(self._manager.hook, f"register_{kind}s")
            # This distribution's own components first, then by plugin name: a plugin can't shadow a built-in.
            for impl in sorted(
                hook.get_hookimpls(), key=lambda i: (self._packages.get(i.plugin_name) != BUILT_IN, i.plugin_name)
            ):
                self._call(kind, impl)

    def _call(self, kind: str, impl) -> None:
        package = self._packages.get(impl.plugin_name, "?")

        def register(cls: type[Component]) -> None:
            self.add(kind, cls, plugin=impl.plugin_name, package=package)

        try:
            impl.function(register=register)
        except Exception as exc:
            self._fail(impl.plugin_name, package, f"register_{kind}s raised {type(exc).__name__}: {exc}")

    def add(self, kind: str, cls: type[Component], plugin: str = "<direct>", package: str = "<direct>") -> None:
        base = KINDS[kind]
        if not (isinstance(cls, type) and issubclass(cls, base)):
            self._fail(plugin, package, f"registered {cls!r} as a {kind}, but it is not a {base.__name__} subclass")
            return
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            self._fail(plugin, package, f"{cls.__name__} needs a non-empty string class attribute `name`")
            return
        if not (isinstance(cls.Config, type) and issubclass(cls.Config, BaseModel)):
            self._fail(
                plugin, package, f"{kind} {name!r}: Config must be a pydantic BaseModel subclass, got {cls.Config!r}"
            )
            return
        existing = self.components[kind].get(cls.name)
        if existing is not None:
            self._fail(
                plugin,
                package,
                f"{kind} name {cls.name!r} is already registered by package {existing.package!r}; this one is ignored",
            )
            return
        self.components[kind][cls.name] = ComponentInfo(kind, cls.name, cls, plugin, package)

    def _fail(self, plugin: str, package: str, error: str) -> None:
        failure = PluginFailure(plugin, package, error)
        self.failures.append(failure)
        warnings.warn(f"openattention: {failure}", RuntimeWarning, stacklevel=3)

    def get(self, kind: str, name: str) -> ComponentInfo | None:
        return self.components[kind].get(name)

    def names(self, kind: str) -> list[str]:
        return sorted(self.components[kind])


@functools.cache
def default_registry() -> Registry:
    registry = Registry()
    registry.load_entry_points()
    return registry


def available() -> dict[str, list[str]]:
    """The registered component names per kind: ``{"clusterer": [...], "selector": [...], ...}``."""
    registry = default_registry()
    return {kind: registry.names(kind) for kind in KINDS}
