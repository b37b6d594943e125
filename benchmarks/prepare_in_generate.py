"""Prepare where users pay it: inside ``model.generate`` on the fast path (``handle.static_cache``), per layer.

    python benchmarks/prepare_in_generate.py 16x16384 8x32768

The Llama-3.1-8B-shaped model of ``benchmarks/generate_speed.py`` (32 layers, random bf16 weights), the default spec
at 1% (``gqa: shared``). Per batch × context, two ``generate`` calls of 3 tokens, uncompiled (only the prefill is of
interest): the first in the process pays the compilation of prepare's Triton kernels, the second is the steady
state. Each records the time to the first token (``prefill_s``: the model's dense prefill plus every layer's
prepare), the prepare (``prepare_s``, device time), each layer's prepare in milliseconds (``spans_ms``), the
allocator's retries and device allocations during the call, and ``prepare_share`` = prepare over the model's prefill
(``prefill_s`` − ``prepare_s``): the issue's target is 10%. Writes ``benchmarks/results/prepare_in_generate.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import oa_core as oa

sys.path.insert(0, str(Path(__file__).parent))
import generate_speed  # noqa: E402  (the benchmark's model and clock)

OUT = Path(__file__).parent / "results" / "prepare_in_generate.json"


def main(argv=None) -> int:
    configs = (argv if argv is not None else sys.argv[1:]) or ["16x16384", "8x32768"]
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    model = generate_speed.build_model(False, None, device)
    runs = []
    for config in configs:
        batch, context = (int(x) for x in config.lower().split("x"))
        ids = torch.randint(10, model.config.vocab_size, (batch, context),
                            generator=torch.Generator().manual_seed(0)).to(device)
        for attempt in range(2):
            handle = oa.patch(model, {"gqa": "shared", "budget": {"density": 0.01}})
            before = torch.cuda.memory_stats()
            run = generate_speed.timed_generate(model, ids, 1, 2, disable_compile=True,
                                                past_key_values=handle.static_cache(max_new_tokens=3))
            after = torch.cuda.memory_stats()
            run.update(config=config, attempt=attempt, prepare_s=handle.stats.prepare_seconds,
                       retries=after["num_alloc_retries"] - before["num_alloc_retries"],
                       device_allocs=after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0),
                       spans_ms=[round(float(r.prepare_span) * 1e3, 1) for r in handle.stats.records
                                 if r.phase == "prefill"])
            run["prepare_share"] = run["prepare_s"] / (run["prefill_s"] - run["prepare_s"])
            handle.unpatch()
            print(json.dumps(run), flush=True)
            runs.append(run)
            torch.cuda.empty_cache()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(runs, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
