"""Attention error on a real model's caches: any set of pipeline specs against dense.

Protocol. Tokenize the essay haystack; take N context tokens and the P tokens that follow; capture the chosen layers'
attention inputs in one forward pass (``capture_attention``). Per layer: the cache is the first N keys/values; the
prefill queries (QGC's query geometry) are the queries at [N−256, N); the decode queries are the queries at [N, N+P),
each treated as a decode query over the N-token prefix. The reference is dense attention softmax(s·q·kᵀ)·v over that
prefix in float32 (query head h reads KV head h // g). Every method attends the P queries at once and is scored by
the relative error ‖ô − o‖ / ‖o‖ per (layer, query head, query).

``benchmarks/attention_error.py`` runs it at full size; ``oa demo`` runs a small version.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

import oa_core as oa
from oa_core.analysis.offline_model import (
    OFFLINE_MODELS,
    TEXTS,
    capture_attention,
    haystack_text,
    load_offline_model,
    model_label,
)

PREFILL_QUERIES = 256


def default_layers(num_layers: int, count: int = 6) -> list[int]:
    """``count`` layers evenly spread from the first to the last (0, 6, 12, 17, 23, 29 of 30)."""
    if num_layers <= count:
        return list(range(num_layers))
    return sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)})


def haystack_ids(tokenizer, length: int, text: str = "essays") -> torch.Tensor:
    """The first ``length`` tokens of a haystack ``text`` (``offline_model.TEXTS``), ``[1, length]``; tokenizes only
    the prefix it needs."""
    name, text = text, haystack_text(text)
    chars = 8 * length
    while True:
        ids = tokenizer(text[:chars], return_tensors="pt").input_ids
        if ids.shape[1] >= length:
            return ids[:, :length]
        if chars >= len(text):
            raise ValueError(f"the {name} haystack has only {ids.shape[1]} tokens, fewer than the {length} requested")
        chars *= 2


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """The float32 reference: query ``[B, Hq, T, D]`` over keys/values ``[B, Hkv, N, D]`` → ``[B, Hq, T, D]``."""
    group = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    return torch.softmax(scale * query.float() @ k.transpose(-1, -2), dim=-1) @ v


def relative_error(estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """‖ô − o‖ / ‖o‖ over the head dim: ``[B, Hq, T, D]`` → ``[B, Hq, T]``."""
    return (estimate.float() - reference).norm(dim=-1) / reference.norm(dim=-1)


def measure(
    methods: dict[str, dict],
    densities: list[float],
    model: str | None = None,
    tokens: int = 4096,
    decode: int = 64,
    layers: list[int] | None = None,
    seed: int = 0,
    progress: bool = True,
    diagnostics: bool = False,
    text: str = "essays",
) -> dict:
    """Mean and p90 relative error and measured density of every spec in ``methods`` at every density.

    ``methods``: name → spec mapping; a spec without ``budget`` is run at ``{"density": d}``, one with a budget keeps
    it (the dense reference). ``diagnostics``: also the weight discrepancy E, the selector's top-32 recall and
    ErrorGate's Spearman (``oa_core.analysis.metrics``). Returns a JSON-ready record: the setting,
    ``results[density][method]`` and timings.
    """
    if tokens < PREFILL_QUERIES or decode < 1:
        raise ValueError(f"tokens must be at least {PREFILL_QUERIES} and decode at least 1")
    timings = {}
    start = time.perf_counter()
    lm, tokenizer = load_offline_model(model)
    num_layers = lm.config.num_hidden_layers
    layers = layers if layers is not None else default_layers(num_layers)
    timings["load_s"] = time.perf_counter() - start

    mark = time.perf_counter()
    captured = capture_attention(lm, haystack_ids(tokenizer, tokens + decode, text), layers)
    del lm
    timings["capture_s"] = time.perf_counter() - mark

    mark = time.perf_counter()
    # density → method → layer → [Hq, P]
    errors: dict[float, dict[str, dict[int, torch.Tensor]]] = {d: {m: {} for m in methods} for d in densities}
    # density → method → metric → [per layer [Hq, P]]
    extra: dict[float, dict[str, dict[str, list[torch.Tensor]]]] = {d: {m: {} for m in methods} for d in densities}
    read: dict[float, dict[str, list[float]]] = {d: {m: [] for m in methods} for d in densities}
    # density → method → bytes per key its selection reads
    scoring: dict[float, dict[str, dict]] = {d: {} for d in densities}
    specs: dict[str, dict] = {}
    kernels: set[str] = set()
    head_dim = None
    bar = tqdm(
        total=len(layers) * len(densities) * len(methods), desc="attention error", unit="pipeline", disable=not progress
    )
    for layer in layers:
        case = layer_case(captured.pop(layer), tokens, decode)
        head_dim = case.keys.shape[-1]
        for density in densities:
            for method, spec in methods.items():
                error, stats, pipe, extra_values = attend_case(
                    {"budget": {"density": density}, **spec}, case, seed, diagnostics
                )
                resolved = pipe.resolved_spec()
                if "budget" not in spec:
                    resolved.pop("budget")
                specs.setdefault(method, resolved)
                errors[density][method][layer] = error
                for name, value in extra_values.items():
                    extra[density][method].setdefault(name, []).append(value)
                read[density][method].append(stats.density)
                scoring[density][method] = pipe.scoring_bytes(head_dim)
                kernels.add(stats.kernel)
                bar.update()
    bar.close()
    timings["pipelines_s"] = time.perf_counter() - mark
    timings["total_s"] = time.perf_counter() - start

    results: dict[str, dict[str, dict]] = {}
    for density in densities:
        results[str(density)] = {}
        for method in methods:
            per_layer = errors[density][method]
            flat = torch.cat([e.flatten() for e in per_layer.values()])
            results[str(density)][method] = {
                "mean_error": flat.mean().item(),
                "p90_error": flat.quantile(0.9).item(),
                "measured_density": sum(read[density][method]) / len(layers),
                "budget_rows": oa.Budget(density=density).rows(tokens),
                "per_layer_mean_error": {str(layer): e.mean().item() for layer, e in per_layer.items()},
                "scoring_bytes_per_key": scoring[density][method],
            }
            for name, values in extra[density][method].items():
                results[str(density)][method][name] = torch.cat([v.flatten() for v in values]).mean().item()
    import transformers

    return {
        "benchmark": "attention_error",
        "model": f"{model_label(model)}, dequantised to float32"
        if model is None or str(model) in OFFLINE_MODELS
        else str(model),
        "data": f"{TEXTS[text]}, from its first character; the tokenizer's default special tokens",
        "text": text,
        "tokens": tokens,
        "decode_positions": [tokens, tokens + decode],
        "prefill_queries": [tokens - PREFILL_QUERIES, tokens],
        "layers": layers,
        "num_layers": num_layers,
        "head_dim": head_dim,
        "densities": densities,
        "seed": seed,
        "specs": specs,
        "kernel": sorted(kernels),
        "results": results,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "openattention": oa.__version__,
        },
        "timings": {k: round(v, 1) for k, v in timings.items()},
    }


@dataclass
class LayerCase:
    """One layer under the protocol: the N-token cache (float32), QGC's prefill queries, the decode queries and the
    dense reference output over the cache."""

    keys: torch.Tensor
    values: torch.Tensor
    prefill: torch.Tensor
    queries: torch.Tensor
    scale: float
    reference: torch.Tensor


def layer_case(captured: tuple, tokens: int, decode: int) -> LayerCase:
    """A layer's captured (queries, keys, values, scale) over ``tokens + decode`` positions → its LayerCase."""
    queries, keys, values, scale = captured
    keys, values = keys[:, :, :tokens].float(), values[:, :, :tokens].float()
    decode_queries = queries[:, :, tokens : tokens + decode].float()
    return LayerCase(
        keys,
        values,
        queries[:, :, tokens - PREFILL_QUERIES : tokens].float(),
        decode_queries,
        scale,
        dense_attention(decode_queries, keys, values, scale),
    )


def attend_case(spec: dict, case: LayerCase, seed: int, with_diagnostics: bool = False):
    """One pipeline on one LayerCase → (relative error ``[Hq, P]``, AttendStats, the pipeline, diagnostics: name →
    ``[Hq, P]``, empty unless ``with_diagnostics``)."""
    pipe = oa.build({**spec, "seed": seed})
    state = pipe.prepare(case.keys, case.values, case.prefill, scale=case.scale)
    out, stats = pipe.attend(case.queries, state, return_stats=True)
    extra = layer_diagnostics(pipe, state, case.queries) if with_diagnostics else {}
    return relative_error(out, case.reference)[0], stats, pipe, extra


def layer_diagnostics(pipe, state, queries) -> dict[str, torch.Tensor]:
    """E, top-32 recall and what every registered component measures (``Component.diagnose``: ErrorGate's Spearman)
    per (query head, query) for one attend, batch row 0; recall and the components' measures only where they apply
    (they need clusters)."""
    from oa_core.analysis import metrics
    from oa_core.components import KINDS
    from oa_core.registry import default_registry

    out = {"weight_discrepancy": metrics.weight_discrepancy(pipe, state, queries)[0]}
    recall = metrics.topk_recall(pipe, state, queries, k=32)
    if recall is not None:
        out["top32_recall"] = recall[0]
    registry = default_registry()
    for kind in KINDS:
        for name in registry.names(kind):
            component = registry.components[kind][name].cls
            out.update({key: value[0] for key, value in component.diagnose(pipe, state, queries).items()})
    return out


def format_table(result: dict) -> str:
    """Rows = methods, columns = densities: mean relative error and (measured read density)."""
    densities = result["densities"]
    methods = list(result["results"][str(densities[0])])
    lines = [
        f"{result['model']}: N={result['tokens']}, {result['decode_positions'][1] - result['tokens']} decode "
        f"queries, layers {result['layers']}",
        f"{'method':32s}" + "".join(f"{f'{d:.0%} err (ρ)':>18s}" for d in densities),
    ]
    for method in methods:
        lines.append(
            f"{method:32s}"
            + "".join(
                f"{r['mean_error']:>10.4f} ({r['measured_density']:.3f})"
                for r in (result["results"][str(d)][method] for d in densities)
            )
        )
    return "\n".join(lines)
