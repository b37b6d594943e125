"""The hooks a plugin module implements to add components.

A plugin is a module named by an entry point in the ``openattention`` group. It implements one or more of these
hooks with ``@oa_core.hookimpl`` and calls ``register(ComponentClass)`` once per component::

    from oa_core import hookimpl

    @hookimpl
    def register_selectors(register):
        register(MySelector)
"""

import pluggy

PROJECT = "openattention"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_clusterers(register):
    """Register Clusterer subclasses: ``register(cls)``."""


@hookspec
def register_selectors(register):
    """Register Selector subclasses: ``register(cls)``."""


@hookspec
def register_allocators(register):
    """Register Allocator subclasses: ``register(cls)``."""


@hookspec
def register_kernels(register):
    """Register Kernel subclasses: ``register(cls)``."""
