"""OpenAttention inside transformers' ``generate()``, through the public ``AttentionInterface``.

    handle = oa.patch(model, {"budget": {"density": 0.03}})   # or: with oa.patch(model, spec): ...
    model.generate(**inputs)                                 # dense prefill, then sparse question and decode
    print(handle.stats.summary())
    oa.unpatch(model)                                        # the model's own attention again

- ``runtime``: the attention function, each layer's runtime (recorded context, live state), ``patch``/``unpatch``.
- ``prefill``: a prompt's dense pass (the model's own sdpa, the valid keys, the queries QGC records).
- ``static_cache``: the fast decode path — a static cache holding each layer's state, one custom op per step
  (imported when first used: it loads transformers' cache machinery, half a second).
- ``stats``: what each layer call read and how long it took (``handle.stats``).
- ``generation``: one prefilled context, many continuations (``prefill_context``, ``generate_from_context``,
  ``answer_logprob``; ``share_question``: a question's leading blocks attended once for both).
"""

from oa_core.integration.generation import (
    Context,
    answer_logprob,
    cache_kwargs,
    extend_context,
    generate_from_context,
    positions,
    prefill_context,
    share_question,
    shared_question_tokens,
)
from oa_core.integration.runtime import (
    IMPLEMENTATION,
    LayerRuntime,
    OpenAttentionHandle,
    openattention_attention,
    patch,
    register,
    runtimes,
    unpatch,
)
from oa_core.integration.stats import GenerationStats, StepRecord

__all__ = [
    "IMPLEMENTATION",
    "Context",
    "GenerationStats",
    "LayerRuntime",
    "OpenAttentionHandle",
    "StepRecord",
    "answer_logprob",
    "cache_kwargs",
    "extend_context",
    "generate_from_context",
    "openattention_attention",
    "patch",
    "positions",
    "prefill_context",
    "register",
    "runtimes",
    "share_question",
    "shared_question_tokens",
    "unpatch",
]
