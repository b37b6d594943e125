"""Where the fused step's plan spends its time (about 60 µs a layer on an H100 at 8 × 16K, shared, whatever its
program count: ``generate_profile_8x16k_h100.json``), and whether ErrorGate's floor by one sort is faster than by
the radix select the plan runs now.

The plan (``plan_programs.plan``, a program per selection row) runs, one after the other: ErrorGate's priorities over
the clusters, the row's shift (``row_shift``: a pass over its shortlist), the floor (``floor_counts``: a radix select
of the shortlist's best ⌊f·E_sel⌋ exact logits, four passes of a 256-bin histogram, then a pass that counts the kept
rows' clusters), the water-filling in float64 and the stores. On the default's real step (``kernel_h200``'s inputs:
the Llama-3.1-8B shape, random keys, a query near some of them; ``specs/openattention.yaml``), its arguments recorded
from the step itself, timed in CUDA graphs (median ms):

- ``plan``: the step's plan as it runs (with the floor), at 1, 2 (the step's), 4 and 8 warps;
- ``plan_without_floor``: the same launch without the shift and the floor (their cost is the difference);
- ``floor_radix``: the floor alone, as the plan computes it (``floor_counts``), a program per row;
- ``floor_sorted``: the floor alone by one ``tl.sort`` of the shortlist's (exact logit, position) keys, the
  ⌊f·E_sel⌋-th largest the cut: the same clusters' counts (checked, ``same_floor``).

    python benchmarks/studies/plan_phases.py [OUT.json]                # on a GPU
    TRITON_INTERPRET=1 python benchmarks/studies/plan_phases.py --cpu  # a small check of the two floors
"""

from __future__ import annotations

import sys

import torch

import headline_scripts  # (benchmarks/ on the path: the headline scripts import)
import oa_core as oa
from kernel_h200 import bench, decode_inputs, graphed, one_token_past
from oa_core.ops.triton_path import tl, triton
from oa_plugins.kernels import flash_step
from oa_plugins.kernels.two_stage_programs import floor_counts, row_budget, unsigned_key

SHAPES = [(8, 16384, "shared"), (16, 16384, "per_head"), (32, 32768, "per_head")]
DENSITIES = (0.01, 0.03)


@triton.jit
def floor_sorted(
    ASSIGNMENT, LENGTH, START, DENSITY, FLOOR_SHARE, LISTED, COUNTS, EXACT, p, Hkv, Gs, CAP, F, TOKENS, L,
    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """``floor_counts`` by one sort: each entry's key (its exact logit's order key, then the earlier entry first —
    the shortlist is in position order) in one block of BLOCK_K ≥ its length; the ⌊f·E_sel⌋-th largest key is the
    cut, and the keys at or above it are the floor's rows."""
    k = tl.load(COUNTS + p)
    budget = row_budget(LENGTH, START, DENSITY, p // (Gs * Hkv), F, TOKENS)
    k2 = tl.floor(tl.load(FLOOR_SHARE) * budget.to(tl.float64)).to(tl.int64)
    k2 = tl.minimum(k2, k.to(tl.int64))
    offs = tl.arange(0, BLOCK_K)
    ok = offs < k
    value = tl.load(EXACT + p * L + offs, mask=ok, other=0.0)
    key = tl.where(ok, (unsigned_key(value) << 31) | (BLOCK_K - 1 - offs).to(tl.int64), -1)  # < 2^63
    ranked = tl.sort(key, descending=True)
    cut = tl.max(tl.where(offs == k2 - 1, ranked, -1), axis=0)  # -1 where k2 is 0: then nothing is kept
    keep = tl.where(ok & (key >= cut) & (cut >= 0), 1, 0) != 0  # (the interpreter takes this form as a mask)
    pos = tl.load(LISTED + p * L + offs, mask=keep, other=0).to(tl.int64)
    cluster = tl.load(ASSIGNMENT + (p // Gs) * CAP + pos, mask=keep & (pos >= 0) & (pos < CAP), other=0)
    return tl.histogram(cluster.to(tl.int32), BLOCK_C, mask=keep)


@triton.jit
def floor_only(
    ASSIGNMENT, LENGTH, START, DENSITY, FLOOR_SHARE, LISTED, COUNTS, EXACT, OUT, Hkv, Gs, CAP, F, TOKENS, L, C,
    SORTED: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Program per selection row: its floor's counts per cluster into ``OUT`` [rows, C], either way."""
    p = tl.program_id(0).to(tl.int64)
    if SORTED:  # (Triton: a constexpr branch, compiled only when taken)
        hist = floor_sorted(
            ASSIGNMENT, LENGTH, START, DENSITY, FLOOR_SHARE, LISTED, COUNTS, EXACT, p, Hkv, Gs, CAP, F, TOKENS, L,
            BLOCK, BLOCK_C,
        )  # fmt: skip
    else:
        hist = floor_counts(
            ASSIGNMENT, LENGTH, START, DENSITY, FLOOR_SHARE, LISTED, COUNTS, EXACT, p, Hkv, Gs, CAP, F, TOKENS, L,
            BLOCK, BLOCK_C,
        )  # fmt: skip
    offs = tl.arange(0, BLOCK_C)
    tl.store(OUT + p * C + offs, hist, mask=offs < C)


def recorded_plan(batch: int, context: int, gqa: str, density: float, device: torch.device):
    """The default's fused step at one shape, run once → (the step, the state, the plan's recorded arguments)."""
    keys, values, prefill, query = decode_inputs(batch, context, device)
    spec = oa.load_spec("specs/openattention.yaml").model_dump(mode="json")
    spec.update(gqa=gqa, kernel="flash", budget={"density": density})
    pipe = oa.build(spec)
    static, (cache_k, cache_v), _, _ = one_token_past(pipe.prepare(keys, values, prefill))
    fused = static.fused
    if fused is None:
        raise SystemExit("no fused step at this shape: nothing to time")
    calls = []
    real = fused.plan
    fused.plan = lambda *args: (calls.append(args), real(*args))[1]
    fused.run(static, query, cache_k, cache_v)
    fused.plan = real
    return fused, static, calls[0]


def floor_runner(fused, static, listing, Gs: int, sorted_: bool):
    """The floor alone over the recorded shortlist → (a function that runs it, its output [rows, C])."""
    rows, L = listing.listed.shape
    C = static.num_clusters
    out = torch.empty(rows, C, dtype=torch.int32, device=listing.listed.device)
    block = triton.next_power_of_2(L) if sorted_ else flash_step.stages.RADIX_BLOCK
    block_c, warps = flash_step.launch_config(C)
    H, cap = static.assignment.shape[1], static.assignment.shape[-1]

    def run():
        floor_only[(rows,)](
            static.assignment, static.length, static.start, fused.density, fused.two_stage.floor_t, listing.listed,
            listing.counts, listing.exact, out, H, Gs, cap, fused.fixed, fused.tokens, L, C,
            SORTED=sorted_, BLOCK=block, BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip

    return run, out


def measure(batch: int, context: int, gqa: str, density: float, device: torch.device, timed: bool) -> dict:
    fused, static, recorded = recorded_plan(batch, context, gqa, density, device)
    listing, Gs = recorded[3], recorded[6]
    unfloored = (*recorded[:3], None, *recorded[4:])
    radix, radix_out = floor_runner(fused, static, listing, Gs, sorted_=False)
    by_sort, sort_out = floor_runner(fused, static, listing, Gs, sorted_=True)
    radix(), by_sort()
    record = {"batch": batch, "context": context, "gqa": gqa, "density": density, "rows": listing.listed.shape[0]}
    record["shortlist_mean"] = round(float(listing.counts.float().mean()), 1)
    record["floor_rows_mean"] = round(float(radix_out.sum(-1).float().mean()), 1)
    record["same_floor"] = bool(torch.equal(radix_out, sort_out))
    if not timed:
        return record
    original = flash_step.launch_config, flash_step.PLAN_WARPS
    for warps in (1, 2, 4, 8):
        flash_step.launch_config, flash_step.PLAN_WARPS = (lambda C, w=warps: (original[0](C)[0], w)), warps
        record[f"plan_{warps}_warps_ms"] = round(bench(graphed(lambda: fused.plan(*recorded))), 4)
    flash_step.launch_config, flash_step.PLAN_WARPS = original
    record["plan_without_floor_ms"] = round(bench(graphed(lambda: fused.plan(*unfloored))), 4)
    record["floor_radix_ms"] = round(bench(graphed(radix)), 4)
    record["floor_sorted_ms"] = round(bench(graphed(by_sort)), 4)
    return record


def main(argv: list[str]) -> int:
    gpu = [(*shape, density) for shape in SHAPES for density in DENSITIES]
    cpu = [(1, 1024, gqa, density) for gqa in ("per_head", "shared") for density in (0.1, 0.2)]  # above sink + window
    return headline_scripts.sweep(argv, __doc__, measure, gpu, cpu, "same_floor")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
