"""The flash pass's launch parameters on the H200, timed in the fused static step (CUDA graph) at the benchmark's
shapes, with the rows and output checked against the reference; then each compiled kernel's registers and spills.

    python benchmarks/studies/flash_launch_sweep.py OUT.json            # warps and pipelining stages of sparse_pass,
                                                                        # and the selection's warps
    python benchmarks/studies/flash_launch_sweep.py OUT.json partition  # how the pass splits a row into programs:
                                                                        # block_k (bk) and clusters_per_chunk (cc)
    python benchmarks/studies/flash_launch_sweep.py OUT.json occupancy  # fewer stages or warps: more programs per SM
"""

import importlib
import json
import sys

import torch
import triton

import headline_scripts  # noqa: F401 (benchmarks/ on the path: the headline scripts import)
import oa_core as oa
from kernel_h200 import bench, decode_inputs, graphed, kernel_breakdown, repeated_fused_step
from oa_core.components import PooledClusters
from oa_core.ops import selection as selmod
from oa_plugins.kernels.flash import FlashKernel
from oa_plugins.kernels.reference import TorchKernel

dev = torch.device("cuda")
base_warps = selmod._warps
results = []
SHAPES = [(16, 16384, (0.01, 0.03)), (8, 32768, (0.01, 0.03)), (32, 32768, (0.01,))]
GROUPS = {
    "launch": [
        dict(),
        dict(fw=8),
        dict(fw=8, fs=2),
        dict(fw=4, fs=2),
        dict(fw=8, fs=1),
        dict(fw=8, fs=4),
        dict(fw=8, sw=4),
        dict(fw=8, sw=1),
        dict(fw=8, bw=4),
    ],
    "partition": [dict(), dict(bk=32), dict(bk=128), dict(cc=32)],
    "occupancy": [dict(), dict(fs=1), dict(fw=2, fs=1), dict(fw=2), dict(fs=1, bk=32)],
}
VARIANTS = GROUPS[sys.argv[2] if len(sys.argv) > 2 else "launch"]
# A variant's unnamed knobs keep FlashKernel's defaults.
DEFAULT = dict(
    fw=FlashKernel.num_warps, fs=FlashKernel.num_stages, bk=FlashKernel.block_k, cc=FlashKernel.clusters_per_chunk
)
for B, N, dens in SHAPES:
    keys, values, prefill, query = decode_inputs(B, N, dev)
    for density in dens:
        pipe = oa.build({"kernel": "flash", "gqa": "shared", "budget": {"density": density}})
        st, (ck, cv), run = repeated_fused_step(pipe, keys, values, prefill, query)
        k = pipe.kernel
        out0, sel = run()
        pooled = st.pooled
        refout, _ = TorchKernel().attend(
            query, ck, cv, sel, PooledClusters(pooled.count, pooled.key_sum, pooled.value_sum, st.assignment), st.scale
        )
        for v in VARIANTS:
            k.num_warps, k.num_stages = v.get("fw", DEFAULT["fw"]), v.get("fs", DEFAULT["fs"])
            k.block_k, k.clusters_per_chunk = v.get("bk", DEFAULT["bk"]), v.get("cc", DEFAULT["cc"])
            sw, bw = v.get("sw"), v.get("bw")
            selmod._warps = lambda block, sw=sw, bw=bw: (
                (sw or base_warps(block)) if block <= 1024 else (bw or base_warps(block))
            )
            out, sel2 = run()
            err = float((out.float() - refout.float()).norm() / refout.float().norm())
            same = bool(torch.equal(sel2.index, sel.index))
            t = bench(graphed(run))
            kb = kernel_breakdown(run)
            r = {
                "batch": B,
                "context": N,
                "density": density,
                **v,
                "step_graph_ms": round(t, 4),
                "err": err,
                "same_rows": same,
                **{
                    n: kb.get(n)
                    for n in (
                        "sparse_pass",
                        "merge",
                        "_select_kernel",
                        "project",
                        "_group_int8_scores",
                        "grow",
                        "plan",
                        "_cluster_stats",
                    )
                },
            }
            results.append(r)
            print(json.dumps(r), flush=True)
        k.num_warps, k.num_stages, k.block_k, k.clusters_per_chunk = (DEFAULT[x] for x in ("fw", "fs", "bk", "cc"))
        selmod._warps = base_warps
        del st, ck, cv, run
    del keys, values
    torch.cuda.empty_cache()
with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=1)
# registers and spills of every compiled kernel
mods = [
    "oa_plugins.kernels.flash",
    "oa_plugins.kernels.flash_step",
    "oa_core.ops.selection",
    "oa_plugins.selectors.qgs",
    "oa_core.ops.cluster_stats",
]
for m in mods:
    mod = importlib.import_module(m)
    for name in dir(mod):
        fn = getattr(mod, name)
        if isinstance(fn, triton.runtime.jit.JITFunction):
            for caches in getattr(fn, "device_caches", {}).values():
                for kern in caches[0].values():
                    try:
                        kern._init_handles()
                        print(
                            "REGS",
                            m.split(".")[-1],
                            name,
                            "warps",
                            kern.metadata.num_warps,
                            "stages",
                            kern.metadata.num_stages,
                            "regs",
                            kern.n_regs,
                            "spills",
                            kern.n_spills,
                        )
                    except Exception as e:
                        print("REGS", name, "?", e)
