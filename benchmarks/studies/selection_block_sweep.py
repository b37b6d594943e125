"""The per-cluster selection's launch shape on the H200: its smallest block (``FusedStep.select_block``, the first size
class's smaller path; ``selection.smallest_block`` picks it from the clusters' mean size) and ``FEW_PICKS`` (quotas up
to it picked one at a time, larger ones by bisection), timed in the fused static step (CUDA graph) at the
benchmark's shapes, the rows and output checked against the first variant's.
``python benchmarks/studies/selection_block_sweep.py OUT.json``."""

import json
import sys

import torch

import headline_scripts  # noqa: F401 (benchmarks/ on the path: the headline scripts import)
import oa_core as oa
from kernel_h200 import bench, decode_inputs, graphed, kernel_breakdown, repeated_fused_step
from oa_core.ops import selection as selmod

SHAPES = [(16, 16384, (0.01, 0.03)), (8, 32768, (0.01, 0.03)), (32, 32768, (0.01,))]
VARIANTS = [
    {"small": 512, "few": 16},
    {"small": 256, "few": 16},
    {"small": 512, "few": 8},
    {"small": 512, "few": 4},
    {"small": 256, "few": 8},
]


def main(out_path: str) -> None:
    dev = torch.device("cuda")
    results = []
    for B, N, densities in SHAPES:
        keys, values, prefill, query = decode_inputs(B, N, dev)
        for density in densities:
            pipe = oa.build({"kernel": "flash", "gqa": "shared", "budget": {"density": density}})
            st, _, run = repeated_fused_step(pipe, keys, values, prefill, query)
            chosen = st.fused.select_block
            first = None
            for v in VARIANTS:
                st.fused.select_block, selmod.FEW_PICKS = v["small"], v["few"]
                out, sel = run()
                first = first or (out, sel.index)
                same = bool(torch.equal(sel.index, first[1])) and bool(torch.equal(out, first[0]))
                r = {
                    "batch": B,
                    "context": N,
                    "density": density,
                    **v,
                    "rule_picks": chosen,
                    "step_graph_ms": round(bench(graphed(run)), 4),
                    "same_rows_and_out": same,
                    "select_ms": kernel_breakdown(run).get("_select_kernel"),
                    "S": st.members.shape[-1],
                }
                results.append(r)
                print(json.dumps(r), flush=True)
            selmod.FEW_PICKS = 16
            del st, run
        del keys, values
        torch.cuda.empty_cache()
    with open(out_path, "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
