"""``oa demo``: OpenAttention against oracle top-k on the real KV cache of the offline model, at one read density.

The small version of benchmarks/attention_error.py (same protocol, ``oa_core.attention_error``): a couple of
thousand tokens of essay text, the model's own next-token queries as decode queries, six layers across depth.
"""

from __future__ import annotations

from oa_core.attention_error import format_table, measure

DEMO_METHODS = {
    "openattention": {},  # the defaults: qgc / qgs / errorgate / proxy tail
    "oracle-topk": {"selector": "oracle", "allocator": "global", "tail": "discard"},
}


def run_demo(model: str | None = None, tokens: int = 2048, density: float = 0.03) -> int:
    methods = {name: {**spec, "sink": 4, "local": 16} for name, spec in DEMO_METHODS.items()}
    print(f"OpenAttention demo: {tokens} tokens of essay text, 16 decode queries, read density {density:.0%} "
          "(sink 4 + local 16 included)")
    result = measure(methods, [density], model=model, tokens=tokens, decode=16)
    print(format_table(result))
    ours, theirs = (result["results"][str(density)][m]["mean_error"] for m in DEMO_METHODS)
    print(f"\nOpenAttention's mean relative output error is {ours / theirs:.2f}x oracle top-k's at the same "
          f"{density:.0%} read: the unread tail, folded into one proxy per cluster, is estimated instead of dropped.")
    print(f"kernel: {', '.join(result['kernel'])}; time: {result['timings']}")
    return 0
