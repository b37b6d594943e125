"""OpenAttention: sparse decode attention that reads a few percent of the KV cache exactly and approximates the rest
with one count-aware proxy per cluster of keys.

    import oa_core as oa
    pipe = oa.build({"clusterer": "qgc", "selector": "pq", "budget": {"density": 0.03}})
"""

from oa_core.components import (
    AllocationInput,
    Allocator,
    Clusterer,
    Clusters,
    Component,
    Kernel,
    PooledClusters,
    Selection,
    Selector,
    group_queries,
)
from oa_core.contracts import ContractViolation
from oa_core.hookspecs import hookimpl
from oa_core.integration import (
    Context,
    GenerationStats,
    OpenAttentionHandle,
    answer_logprob,
    cache_kwargs,
    extend_context,
    generate_from_context,
    patch,
    prefill_context,
    share_question,
    unpatch,
)
from oa_core.integration import register as register_attention
from oa_core.moved import install as _install_moved
from oa_core.pipeline import AttendStats, Explanation, Pipeline, build
from oa_core.registry import available
from oa_core.spec import Budget, ComponentSpec, PipelineSpec, SpecError, load_spec
from oa_core.state import PipelineState

__version__ = "0.1.0"

_install_moved()  # 0.1's flat module paths, deprecated (oa_core/moved.py)

__all__ = [
    "AllocationInput",
    "Allocator",
    "AttendStats",
    "Budget",
    "Clusterer",
    "Clusters",
    "Component",
    "ComponentSpec",
    "Explanation",
    "Kernel",
    "Pipeline",
    "PipelineSpec",
    "PipelineState",
    "PooledClusters",
    "Selection",
    "Selector",
    "SpecError",
    "ContractViolation",
    "group_queries",
    "available",
    "build",
    "hookimpl",
    "load_spec",
    "Context",
    "GenerationStats",
    "OpenAttentionHandle",
    "answer_logprob",
    "cache_kwargs",
    "extend_context",
    "generate_from_context",
    "patch",
    "prefill_context",
    "register_attention",
    "share_question",
    "unpatch",
]
