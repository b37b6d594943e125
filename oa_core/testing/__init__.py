"""What a component's author tests with: the conformance kit (``conformance``) and the float64 references of the
paper's equations (``references``)."""

from oa_core.testing.conformance import (
    check_allocator,
    check_clusterer,
    check_component,
    check_kernel,
    check_pipeline,
    check_selector,
    make_inputs,
)

__all__ = [
    "check_allocator",
    "check_clusterer",
    "check_component",
    "check_kernel",
    "check_pipeline",
    "check_selector",
    "make_inputs",
]
