"""The CPU speed of ``oa eval`` on the README's small example, before and after a change, from the runs' records.

Run the README's example once per checkout (same machine, nothing else running), timing the whole command:

    /usr/bin/time -f "%e" oa eval --specs specs/dense.yaml specs/openattention.yaml specs/oracle-topk.yaml \\
        --densities 0.1 0.03 --tasks niah_single_1 niah_single_2 --length 4096 --samples 2 --sink 4 \\
        --local-window 16 --out /tmp/readme-eval-<label>

then summarise the runs (the first is the baseline):

    python benchmarks/studies/eval_cpu_speed.py --run 2f68294 /tmp/readme-eval-base 804.1 \\
        --run f7e7be0 /tmp/readme-eval-merged 558.0 --run 1534f44 /tmp/readme-eval-bestof 495.07 \\
        --run 5e23779 /tmp/readme-eval-rowsread 462.42 --out benchmarks/studies/results/eval_cpu_readme_example.json

and, re-measured on another day (the baseline again, then the newer checkouts):

    python benchmarks/studies/eval_cpu_speed.py --run 2f68294 /tmp/readme-eval-base2f 1231.83 \
        --run f969b8e /tmp/readme-eval-base 730.86 --run f360a09 /tmp/readme-eval-new 704.06 \
        --out benchmarks/studies/results/eval_cpu_readme_example_2026-12-04.json

and, where the machine's speed drifts within the hour, a checkout bracketing the baseline (run before and after it;
``--bracket`` gives their mean against the baseline):

    python benchmarks/studies/eval_cpu_speed.py --run 2f68294 /tmp/readme-eval-base2f-s2 1519.86 \
        --run 438119f /tmp/readme-eval-share438 724.86 --run 8dcbf37 /tmp/readme-eval-native56 588.58 \
        --run "8dcbf37 again" /tmp/readme-eval-native-s2 855.77 --bracket 8dcbf37 "8dcbf37 again" \
        --out benchmarks/studies/results/eval_cpu_readme_example_2026-12-04b.json

Per run: the wall time given (the command's, model load included), and from the records the seconds each spec ×
density spent decoding (``generate_s``, summed over tasks and samples) and prefilling (once per sample). Each run is
compared with the first: the speed-up, and whether every answer is the same and by how much the answer
log-likelihoods differ.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections import defaultdict
from pathlib import Path


def load(folder: Path) -> dict[tuple, dict]:
    records = {}
    for path in sorted(folder.glob("records*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            records[(r["spec"], r["density"], r["task"], r["sample"])] = r
    if not records:
        raise SystemExit(f"no records*.jsonl in {folder}")
    return records


def summary(records: dict[tuple, dict], wall: float) -> dict:
    decode = defaultdict(float)
    prefill = {}
    for (spec, density, task, sample), r in records.items():
        decode[spec if density is None else f"{spec} {density:g}"] += r["generate_s"]
        prefill[(task, sample)] = r["prefill_s"]  # one prefill per sample, shared by the specs
    return {
        "wall_s": wall,
        "decode_s": {k: round(v, 1) for k, v in sorted(decode.items())},
        "decode_total_s": round(sum(decode.values()), 1),
        "prefill_total_s": round(sum(prefill.values()), 1),
        "cells": len(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--run",
        nargs=3,
        action="append",
        required=True,
        metavar=("LABEL", "RECORDS_DIR", "WALL_S"),
        help="a run: its label (e.g. the commit), its --out folder, its wall time in seconds",
    )
    parser.add_argument(
        "--bracket",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="two runs of one checkout, one before the baseline's run and one after it: their mean "
        "wall time against the baseline's (a drift of the machine's speed over the three runs "
        "cancels where it is even)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = [(label, load(Path(folder)), float(wall)) for label, folder, wall in args.run]
    base_label, base, base_wall = runs[0]
    result = {
        "benchmark": "oa eval, the README's small example (3 specs x 2 densities x 2 tasks x 2 samples, 4K)",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "baseline": base_label,
        "runs": {},
    }
    for label, records, wall in runs:
        entry = summary(records, wall)
        shared = sorted(set(records) & set(base), key=str)
        entry["speedup_wall"] = round(base_wall / wall, 2)
        entry["speedup_decode"] = round(summary(base, base_wall)["decode_total_s"] / entry["decode_total_s"], 2)
        entry["same_answers"] = all(records[k]["output"] == base[k]["output"] for k in shared)
        entry["max_logprob_diff"] = max(
            (abs(records[k]["answer_logprob"] - base[k]["answer_logprob"]) for k in shared), default=None
        )
        result["runs"][label] = entry
        print(
            f"{label}: wall {wall:.0f} s ({entry['speedup_wall']}x), decode {entry['decode_total_s']} s "
            f"({entry['speedup_decode']}x), same answers: {entry['same_answers']}, "
            f"max log-lik difference {entry['max_logprob_diff']}"
        )
    if args.bracket:
        walls = [result["runs"][label]["wall_s"] for label in args.bracket]
        mean = sum(walls) / 2
        result["bracket"] = {
            "runs": args.bracket,
            "mean_wall_s": round(mean, 2),
            "speedup_wall": round(base_wall / mean, 2),
        }
        print(f"bracket {' + '.join(args.bracket)}: mean wall {mean:.0f} s ({result['bracket']['speedup_wall']}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
