"""The reference pipeline on CUDA against the same pipeline on the CPU, at Llama-3.1-8B decode shapes, and the
transformers integration on CUDA (a small random Llama in fp32/bf16/fp16).

Not a speed benchmark (the flash kernel's is): it checks that every stage runs on the GPU and gives the CPU's
answer — same clusters, same selection, outputs within float32 / bf16 rounding — with no NaN, and that generate()
through OpenAttention behaves on the GPU as the CPU tests require. Writes benchmarks/results/cuda_consistency.json.

    python benchmarks/cuda_consistency.py          # needs a CUDA device
    python benchmarks/cuda_consistency.py --only static --out benchmarks/results/cuda_consistency_static.json

``--only static``: the fast decode path alone — generate on the static cache, eager and compiled (CUDA graphs: the
fused step's two streams), against the default cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import oa_core as oa
from oa_core.analysis.provenance import provenance

SHAPE = dict(batch=2, kv_heads=8, group=4, tokens=8192, dim=128, decode=4)


def inputs(dtype: torch.dtype, seed: int = 0):
    """Clustered keys (real caches are clustered), values, prefill and decode queries on the CPU."""
    s = SHAPE
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(s["batch"], s["kv_heads"], 48, s["dim"], generator=gen) * 2
    member = torch.randint(48, (s["batch"], s["kv_heads"], s["tokens"]), generator=gen)
    keys = centres.gather(2, member[..., None].expand(-1, -1, -1, s["dim"]))
    keys = keys + torch.randn(keys.shape, generator=gen)
    values = torch.randn(keys.shape, generator=gen)
    heads = s["kv_heads"] * s["group"]
    prefill = torch.randn(s["batch"], heads, 256, s["dim"], generator=gen)
    decode = torch.randn(s["batch"], heads, s["decode"], s["dim"], generator=gen)
    return [t.to(dtype) for t in (keys, values, prefill, decode)]


SPARSE = {"clusterer": {"name": "qgc", "num_clusters": 16}, "sink": 4, "local": 16, "budget": {"density": 0.1}}


# The integration checks' small models: 4 layers of random weights (seed 0), 8 query heads on 2 KV heads.
SMALL = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    attn_implementation="sdpa",
)


def small_llama(dtype: torch.dtype):
    """A small Llama on CUDA, for the integration checks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL)).eval().to("cuda", dtype)


def small_gemma3():
    """A small Gemma 3 on CUDA in float32: two sliding-window layers (a window of 128) beside two full-attention ones,
    for the static cache's check."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    layers = ["sliding_attention", "full_attention"] * 2
    config = Gemma3TextConfig(**SMALL, head_dim=64, sliding_window=128, layer_types=layers)
    return Gemma3ForCausalLM(config).eval().to("cuda")


def integration_checks() -> list[dict]:
    """generate() through oa.patch on CUDA: a covering budget is token-identical to sdpa; a sparse one stays finite
    and within its budget; a left-padded batch answers like each prompt alone."""
    records = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = small_llama(dtype)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 256, (1, n), generator=gen).cuda() for n in (700, 1000)]

        def greedy(ids, mask=None, model=model):
            mask = torch.ones_like(ids) if mask is None else mask
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0
                )
            return out[:, ids.shape[1] :]

        expected = greedy(prompts[1])
        with oa.patch(model, {**SPARSE, "budget": {"tokens": 100_000}}):
            same = torch.equal(greedy(prompts[1]), expected)
        with oa.patch(model, SPARSE) as handle:
            alone = [greedy(p) for p in prompts]
            decode = [r for r in handle.stats.records if r.phase == "decode"]
            ids = torch.zeros(2, 1000, dtype=torch.long, device="cuda")
            mask = torch.zeros_like(ids)
            for row, p in enumerate(prompts):
                ids[row, -p.shape[1] :], mask[row, -p.shape[1] :] = p[0], 1
            batched = greedy(ids, mask)
        padded_same = all(torch.equal(batched[row], alone[row][0]) for row in range(2))
        within = all(not r.dense and r.density <= 0.1 for r in decode)
        record = {
            "check": "integration",
            "dtype": str(dtype),
            "covering_budget_equals_sdpa": same,
            "sparse_density_within_budget": within,
            "left_padded_equals_alone": padded_same,
            "mean_sparse_density": sum(r.density for r in decode) / len(decode),
            "ok": same and within and (padded_same or dtype != torch.float32),
        }
        records.append(record)
        print(json.dumps(record))
    return records


def static_cache_checks() -> list[dict]:
    """generate() on the fast decode path on CUDA (float32): the static cache eagerly and compiled by generate (CUDA
    graphs, where the fused step's scores and growth run on two streams) give the default cache's tokens and logits,
    for a left-padded batch, with every sparse layer on the fused step: on a Llama, and on a Gemma 3 whose sliding
    layers decode through the model's own attention in its window."""
    return [
        static_cache_check(name, model)
        for name, model in (("llama", small_llama(torch.float32)), ("gemma3", small_gemma3()))
    ]


def static_cache_check(name: str, model) -> dict:
    """``static_cache_checks`` for one model."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (2, 1000), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[1, :300] = 0
    spec = {**SPARSE, "kernel": "flash"}

    def greedy(**kwargs):
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
                **kwargs,
            )
        return out.sequences[:, ids.shape[1] :], torch.stack(out.scores)

    with oa.patch(model, spec) as handle:
        tokens, logits = greedy()
        cache = handle.static_cache(max_new_tokens=16)
        eager_tokens, eager = greedy(**oa.cache_kwargs(model, cache), disable_compile=True)
        sparse = [layer for layer in cache.layers if layer.runtime.keeps_own is None]
        fused = all(layer.state is not None and layer.state.fused is not None for layer in sparse)
        cuda = [layer.state.fused.shortlist_note or "cuda" for layer in sparse if fused]
        graph_tokens, graph = greedy(**oa.cache_kwargs(model, handle.static_cache(max_new_tokens=16)))
    record = {
        "check": "static cache",
        "model": name,
        "sparse_layers": len(sparse),
        "dtype": "torch.float32",
        "every_layer_fused": fused,
        "shortlist": sorted(set(cuda)),  # "cuda": the CUDA shortlist served every layer (sm_90+); else why not
        "eager_static_vs_default_max_logit_difference": float((eager - logits).abs().max()),
        "graphed_static_vs_eager_max_logit_difference": float((graph - eager).abs().max()),
        "same_tokens": bool(torch.equal(eager_tokens, tokens) and torch.equal(graph_tokens, tokens)),
    }
    record["ok"] = (
        fused
        and record["same_tokens"]
        and record["eager_static_vs_default_max_logit_difference"] < 1e-4
        and record["graphed_static_vs_eager_max_logit_difference"] < 1e-4
    )
    print(json.dumps(record))
    return record


def pipeline_checks() -> list[dict]:
    """The pipeline on CUDA against the CPU, at the decode shape, for four specs in float32 and bfloat16."""
    records = []
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        cpu_inputs = inputs(dtype)
        gpu_inputs = [t.cuda() for t in cpu_inputs]
        for spec in (
            {},
            {"gqa": "shared"},
            {"tail": "discard", "selector": "oracle", "allocator": "global"},
            {"tail": "sample"},
        ):
            pipe = oa.build({**spec, "budget": {"density": 0.03}})
            out_cpu, stats_cpu = pipe.attend(cpu_inputs[3], pipe.prepare(*cpu_inputs[:3]), return_stats=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            state = pipe.prepare(*gpu_inputs[:3])
            out_gpu, stats_gpu = pipe.attend(gpu_inputs[3], state, return_stats=True)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            same_clusters = torch.equal(state.pooled.assignment.cpu(), pipe.prepare(*cpu_inputs[:3]).pooled.assignment)
            error = float((out_gpu.cpu().float() - out_cpu.float()).norm() / out_cpu.float().norm())
            # Tail samples come from the device's own generator, so only the sample tail may differ by device.
            comparable = spec.get("tail") != "sample"
            record = {
                "dtype": str(dtype),
                "spec": spec,
                "relative_difference": error,
                "tolerance": tolerance,
                "same_clusters": same_clusters,
                "finite": bool(torch.isfinite(out_gpu).all()),
                "density_cpu": stats_cpu.density,
                "density_gpu": stats_gpu.density,
                "gpu_prepare_plus_attend_s": round(seconds, 3),
                "ok": bool(torch.isfinite(out_gpu).all()) and (error < tolerance or not comparable),
            }
            records.append(record)
            print(json.dumps(record))
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["static"], default=None, help="run only these checks")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cuda_consistency.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    records = [] if args.only == "static" else pipeline_checks() + integration_checks()
    records += static_cache_checks()
    import transformers

    result = {
        "benchmark": "cuda_consistency",
        "shape": SHAPE,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "records": records,
        "all_ok": all(r["ok"] for r in records),
        "provenance": provenance("cuda"),
    }
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("all ok" if result["all_ok"] else "MISMATCH")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
