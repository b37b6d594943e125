"""benchmarks/studies/host_profile.py's summary: calls and times per step, and who calls torch's dynamo-disabled
wrapper."""

import cProfile
import pstats

import torch

from conftest import load_benchmark


@torch._disable_dynamo
def _disabled(x):
    return x + 1


def _one_step(x):
    for _ in range(3):
        x = _disabled(x)
    return sum(range(1000)) + x


def test_summary_counts_per_step_and_names_the_wrappers_callers():
    bench = load_benchmark("host_profile")
    profile = cProfile.Profile()
    profile.enable()
    for step in range(4):
        _one_step(step)
    profile.disable()
    out = bench.summarize(pstats.Stats(profile), steps=4)
    rows = {r["function"]: r for r in out["by_cumulative_time"]}
    step = next(r for name, r in rows.items() if name.endswith("(_one_step)"))
    assert step["calls_per_step"] == 1.0 and step["cumulative_ms_per_step"] >= step["own_ms_per_step"] > 0
    callers = out["dynamo_disabled_wrapper_callers"]
    assert [(name.endswith("(_one_step)"), c["calls_per_step"]) for name, c in callers.items()] == [(True, 3.0)]
    callees = out["dynamo_disabled_wrapper_callees"]
    assert [c["calls_per_step"] for name, c in callees.items() if name.endswith("(_disabled)")] == [3.0]
