"""Where the host's time per decode step goes inside ``generate``: Python's cProfile over decode steps after the
step is compiled and captured, per method — what runs on the CPU while the device waits (generate's loop, the
masks, dynamo's guards, the CUDA graph's launch).

    python benchmarks/studies/host_profile.py --config 16x16384 --out benchmarks/studies/results/host_profile_h200.json
    python benchmarks/studies/host_profile.py --tiny --device cpu --config 1x512 --methods dense-engine  # a smoke test

The model and methods are ``benchmarks/generate_speed.py``'s. Each method generates ``--skip`` + ``--steps`` + 2
tokens; a stopping criterion waits for the device after every step and profiles steps ``--skip`` to ``--skip`` +
``--steps``. Per method the JSON holds the time per step under the profiler (it slows the host: an upper bound),
the functions of largest own and cumulative time per step, and who calls torch's dynamo-disabled wrappers
(``torch/_compile.py``'s ``inner``), which run on the host each time they are called. Prints the same.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import headline_scripts  # noqa: F401 (benchmarks/ on the path: the headline scripts import)
import generate_speed  # the benchmark's model and methods

# torch._disable_dynamo's wrappers (one calls the other)
WRAPPERS = (("_compile.py", "inner"), ("eval_frame.py", "_fn"))


class ProfiledSteps(StoppingCriteria):
    """Waits for the device after every step; profiles the steps from ``first`` to ``last`` (exclusive)."""

    def __init__(self, device: torch.device, first: int, last: int) -> None:
        self.device, self.first, self.last = device, first, last
        self.step, self.profile, self.times = 0, cProfile.Profile(), []

    def __call__(self, input_ids, scores, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        if self.step == self.first:
            self.profile.enable()
        elif self.step == self.last:
            self.profile.disable()
        self.step += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def summarize(stats: pstats.Stats, steps: int, top: int = 25) -> dict:
    """A profile over ``steps`` steps → the ``top`` functions by own and by cumulative time (calls and ms per step),
    and the callers of the dynamo-disabled wrapper and the functions it wraps (its callees; calls per step)."""

    def name(func):
        path, line, function = func
        return f"{'/'.join(Path(path).parts[-3:])}:{line}({function})" if line else function

    rows = [
        {
            "function": name(func),
            "calls_per_step": round(calls / steps, 2),
            "own_ms_per_step": round(1e3 * own / steps, 4),
            "cumulative_ms_per_step": round(1e3 * cumulative / steps, 4),
        }
        for func, (_, calls, own, cumulative, _) in stats.stats.items()
    ]

    def wrapper(func):
        return any(func[0].endswith(path) and func[2] == function for path, function in WRAPPERS)

    def per_step(calls, cumulative):
        return {"calls_per_step": round(calls / steps, 2), "cumulative_ms_per_step": round(1e3 * cumulative / steps, 4)}

    callers, callees = {}, {}
    for func, (_, _, _, _, by) in stats.stats.items():
        for caller, (_, calls, _, cumulative) in by.items():
            if wrapper(func) and not wrapper(caller):
                callers[name(caller)] = per_step(calls, cumulative)
            if wrapper(caller) and not wrapper(func):
                callees[name(func)] = per_step(calls, cumulative)
    return {
        "by_own_time": sorted(rows, key=lambda r: -r["own_ms_per_step"])[:top],
        "by_cumulative_time": sorted(rows, key=lambda r: -r["cumulative_ms_per_step"])[:top],
        "dynamo_disabled_wrapper_callers": callers,
        "dynamo_disabled_wrapper_callees": callees,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="16x16384", help="BATCHxCONTEXT (default: %(default)s)")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["no-attention", "dense-engine", "openattention"],
        choices=["dense-static", "dense-engine", "openattention", "no-attention"],
    )
    parser.add_argument("--density", type=float, default=0.01, help="OpenAttention's (default: %(default)s)")
    parser.add_argument("--skip", type=int, default=10, help="steps before the profiled ones (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="steps profiled (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a toy model instead of the 8B shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="the JSON (default: print only)")
    args = parser.parse_args(argv)
    batch, context = (int(x) for x in args.config.lower().split("x"))
    device = torch.device(args.device)
    torch._dynamo.config.cache_size_limit = 64
    model = generate_speed.build_model(args.tiny, None, device)
    ids = torch.randint(10, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    tokens = args.skip + args.steps + 2
    results = []
    for method in args.methods:
        density = args.density if method == "openattention" else None
        with (
            generate_speed.method_setup(model, method, density, {"gqa": "shared"}, tokens) as (kwargs, _),
            torch.no_grad(),
        ):
            clock = ProfiledSteps(device, args.skip, args.skip + args.steps)
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([clock]),
                **kwargs,
            )
        gaps = [
            b - a
            for a, b in zip(
                clock.times[args.skip : args.skip + args.steps], clock.times[args.skip + 1 : args.skip + args.steps + 1]
            )
        ]
        row = {
            "method": method,
            "density": density,
            "ms_per_step_profiled": round(1e3 * sum(gaps) / len(gaps), 3),
            **summarize(pstats.Stats(clock.profile), args.steps),
        }
        results.append(row)
        print(f"=== {method}: {row['ms_per_step_profiled']:.2f} ms a step under the profiler")
        for r in row["by_cumulative_time"][:15]:
            print(f"  {r['cumulative_ms_per_step']:8.3f} ms  {r['calls_per_step']:6.1f}×  {r['function']}")
        print("  dynamo-disabled wrapper called by:", json.dumps(row["dynamo_disabled_wrapper_callers"]))
        print("  and calls:", json.dumps(row["dynamo_disabled_wrapper_callees"]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"config": args.config, "device": str(device), "steps": args.steps, "results": results}, indent=1
            )
            + "\n"
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
