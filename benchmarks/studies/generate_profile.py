"""Where a decode step's time goes inside ``model.generate``: the device's kernels and the host's share, per method.

    python benchmarks/studies/generate_profile.py                          # on the H200: 16 × 16K, the 8B shape
    python benchmarks/studies/generate_profile.py --config 8x32768 --methods no-attention openattention
    python benchmarks/studies/generate_profile.py --tiny --device cpu --config 2x512 --densities 0.2 --tokens 4 \
        --steps 2

``benchmarks/generate_speed.py`` measures the time per token; this says what it is made of. For each method (the
same ones, set up the same way: ``generate_speed.method_setup``) two ``generate`` calls on one model:

1. timed as generate_speed times it — ``--warmup`` steps, then the mean gap over ``--tokens`` steps with a device
   sync after each (``per_token_ms``);
2. profiled (``torch.profiler``, device and host activity) over ``--steps`` decode steps after the warm-up: the sum of
   the device's kernel times per step (``device_ms``: the device is busy this long), each kernel's time per step and
   per layer, and the host's phases per step — dynamo's guard check (``TorchDynamo Cache Lookup``), the compiled
   region, the CUDA graph's launch. The profiler slows the host, so the host phases are upper bounds; kernel times
   are not affected by it.

``host_ms = per_token_ms − device_ms`` is then the time per token in which the device waits for the host (generate's
own work between steps, the guards, the launch). Writes ``benchmarks/studies/results/generate_profile.json`` and prints
a table.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import StoppingCriteria, StoppingCriteriaList

import headline_scripts  # noqa: F401 (benchmarks/ on the path: the headline scripts import)
import generate_speed as gs  # the model, the methods and the timing of generate_speed

HOST_PHASES = ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "cudaGraphLaunch", "cudaStreamSynchronize")
# The fast path's kernels, by the start of their names (``FusedStep.launch_names``; a CUDA kernel's after the profiler's
# leading "void ", ``void pq_shortlist<…>``; ``_split_pass``: the dense engine's; ``project``, ``grow``,
# ``_cluster_stats`` and ``merge``: the fused step's in earlier commits).
ATTENTION_KERNELS = (
    "prologue",
    "project",
    "grow",
    "_cluster_stats",
    "plan",
    "_group_int8_scores",
    "_group_lut_scores",
    "radix_pass",
    "cut_row",
    "compact",
    "pq_",
    "exact_logits",
    "refine",
    "_select_kernel",
    "sparse_pass",
    "merge",
    "_split_pass",
)


class ProfiledSteps(StoppingCriteria):
    """Profiles decode steps ``[start, start + steps)``: the profiler starts and stops between steps, after a sync."""

    def __init__(self, start: int, steps: int, device: torch.device) -> None:
        self.start, self.steps, self.calls = start, steps, 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(activities=activities)
        self.device = device

    def __call__(self, input_ids, scores, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.calls == self.start:
            self.profiler.start()
        if self.calls == self.start + self.steps:
            self.profiler.stop()
        self.calls += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def profiled_generate(model, ids, method: str, density: float | None, spec: dict, args) -> dict:
    """One ``generate`` of ``method`` with ``--steps`` decode steps profiled → kernels and host phases per step."""
    clock = ProfiledSteps(args.warmup, args.steps, ids.device)
    tokens = args.warmup + args.steps + 1
    with gs.method_setup(model, method, density, spec, tokens) as (kwargs, _), torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            pad_token_id=0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            stopping_criteria=StoppingCriteriaList([clock]),
            **kwargs,
        )
    return summarize(clock.profiler.events(), model.config.num_hidden_layers, args.steps)


def summarize(events, layers: int, steps: int) -> dict:
    """Profiler events over ``steps`` decode steps of a ``layers``-layer model → per step: the device's busy time
    (``device_ms``, the sum of its kernels and copies), its launches, the attention kernels per layer, the host's
    phases, and the 40 longest kernels."""
    kernels: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    host: dict[str, float] = collections.defaultdict(float)
    for event in events:
        if event.device_type.name == "CUDA":
            kernels[event.name][0] += event.device_time_total
            kernels[event.name][1] += 1
        elif event.name.startswith(HOST_PHASES):
            host[event.name.split(":")[0]] += event.cpu_time_total
    table = sorted(
        (
            {"kernel": name[:100], "us_per_step": round(t / steps, 1), "calls_per_step": n / steps}
            for name, (t, n) in kernels.items()
        ),
        key=lambda k: -k["us_per_step"],
    )
    attention = {
        k["kernel"]: round(k["us_per_step"] / layers, 1)
        for k in table
        if k["kernel"].removeprefix("void ").startswith(ATTENTION_KERNELS)
    }
    return {
        "device_ms": round(sum(k["us_per_step"] for k in table) / 1000, 3),
        "launches_per_step": sum(k["calls_per_step"] for k in table),
        "attention_us_per_layer": attention,
        "attention_us_per_layer_total": round(sum(attention.values()), 1),
        "host_phases_ms_per_step_profiled": {k: round(v / steps / 1000, 3) for k, v in host.items()},
        "kernels": table[:40],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="16x16384", help="BATCHxCONTEXT")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["no-attention", "dense-engine", "openattention"],
        choices=["dense-static", "dense-engine", "openattention", "no-attention"],
    )
    parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.03])
    parser.add_argument("--warmup", type=int, default=8, help="decode steps before the timed or profiled ones")
    parser.add_argument("--tokens", type=int, default=31, help="decode steps timed (as generate_speed.py)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the model's")
    parser.add_argument("--tiny", action="store_true", help="a toy model instead of the 8B shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "generate_profile.json")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.steps < 1:
        parser.error("--tokens: at least 2; --steps: at least 1")
    device = torch.device(args.device)
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    batch, context = (int(x) for x in args.config.lower().split("x"))
    model = gs.build_model(args.tiny, args.layers, device)
    ids = torch.randint(10, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    spec = {"gqa": "shared"}
    runs = []
    for method in args.methods:
        for density in args.densities if method == "openattention" else [None]:
            timed = gs.run_method(model, ids, method, density, spec, args)
            profiled = profiled_generate(model, ids, method, density, spec, args)
            ms = timed["per_token_ms"]
            runs.append(
                {
                    "batch": batch,
                    "context": context,
                    "method": method,
                    "density": density,
                    "per_token_ms": ms,
                    "median_step_ms": timed["median_step_ms"],
                    "longest_step_ms": timed["longest_step_ms"],
                    "host_ms": None if ms is None else round(ms - profiled["device_ms"], 3),
                    **profiled,
                }
            )
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "kernels"}), flush=True)
            write(args, model, device, spec, runs)
    print("| method | density | ms / token | device ms | host ms | launches | attention µs / layer |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        density = "" if r["density"] is None else f"{r['density']:.0%}"
        print(
            f"| {r['method']} | {density} | {r['per_token_ms']:.2f} | {r['device_ms']:.2f} | {r['host_ms']:.2f} | "
            f"{r['launches_per_step']:.0f} | {r['attention_us_per_layer_total']:.1f} |"
        )
    print(f"wrote {args.out}")
    return 0


def write(args, model, device: torch.device, spec: dict, runs: list[dict]) -> None:
    """The JSON so far (after every method: a run cut short keeps what it measured)."""
    machine = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers": model.config.num_hidden_layers,
        "model": "tiny" if args.tiny else "Llama-3.1-8B shape",
        "spec": spec,
        "warmup": args.warmup,
        "tokens": args.tokens,
        "profiled_steps": args.steps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
