"""The flash pass's launch parameters on the H200: warps and pipelining stages of ``_sparse_pass`` and the selection's warps,
timed in the fused static step (CUDA graph) at the benchmark's shapes, with the rows and output checked against the
reference; then each compiled kernel's registers and spills. ``python benchmarks/flash_launch_sweep.py OUT.json``."""
import sys, json, torch
sys.path.insert(0, "benchmarks")
from kernel_h200 import graphed, bench, kernel_breakdown, HQ, HKV, D
import oa_core as oa
from oa_core import selection as selmod
from oa_core.static import StaticState
from oa_plugins.kernels.reference import TorchKernel
from oa_core.components import PooledClusters
dev = torch.device("cuda")
base_warps = selmod._warps
results = []
SHAPES = [(16, 16384, (0.01, 0.03)), (8, 32768, (0.01, 0.03)), (32, 32768, (0.01,))]
VARIANTS = [dict(), dict(fw=8), dict(fw=8, fs=2), dict(fw=4, fs=2), dict(fw=8, fs=1), dict(fw=8, fs=4),
            dict(fw=8, sw=4), dict(fw=8, sw=1), dict(fw=8, bw=4)]
for B, N, dens in SHAPES:
    gen = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(B, HKV, N, D, device=dev, generator=gen, dtype=torch.bfloat16)
    values = torch.randn(B, HKV, N, D, device=dev, generator=gen, dtype=torch.bfloat16)
    prefill = torch.randn(B, HQ, 256, D, device=dev, generator=gen, dtype=torch.bfloat16)
    query = (keys[:, torch.arange(HQ, device=dev) // (HQ // HKV), -7] * 1.5).unsqueeze(2).contiguous()
    for density in dens:
        pipe = oa.build({"kernel": "flash", "gqa": "shared", "budget": {"density": density}})
        state = pipe.prepare(keys, values, prefill)
        cap = N + 64
        ck = keys.new_zeros(B, HKV, cap, D); cv = values.new_zeros(B, HKV, cap, D)
        ck[:, :, :N], cv[:, :, :N] = keys, values
        ck[:, :, N], cv[:, :, N] = keys[:, :, -1] * 0.9, values[:, :, -1] * 0.9
        st = StaticState.from_state(state, cap); st.length += 1
        grown = (st.member_counts, st.pooled.count, st.pooled.key_sum, st.pooled.value_sum, st.pooled.key_square_sum)
        saved = [t.clone() for t in grown]
        def run():
            for t, v in zip(grown, saved):
                t.copy_(v)
            return st.fused.run(st, query, ck, cv)
        k = pipe.kernel
        out0, sel = run()
        pooled = st.pooled
        refout, _ = TorchKernel().attend(query, ck, cv, sel, PooledClusters(pooled.count, pooled.key_sum, pooled.value_sum, st.assignment), st.scale)
        for v in VARIANTS:
            k.num_warps, k.num_stages = v.get("fw"), v.get("fs")
            sw, bw = v.get("sw"), v.get("bw")
            selmod._warps = lambda block, sw=sw, bw=bw: (sw or base_warps(block)) if block <= 1024 else (bw or base_warps(block))
            out, sel2 = run()
            err = float((out.float() - refout.float()).norm() / refout.float().norm())
            same = bool(torch.equal(sel2.index, sel.index))
            t = bench(graphed(run))
            kb = kernel_breakdown(run)
            r = {"batch": B, "context": N, "density": density, **v, "step_graph_ms": round(t, 4), "err": err, "same_rows": same,
                 **{n: kb.get(n) for n in ("_sparse_pass", "_merge", "_select_kernel", "_group_int8_scores", "_grow", "_plan", "_cluster_stats")}}
            results.append(r); print(json.dumps(r), flush=True)
        k.num_warps = k.num_stages = None; selmod._warps = base_warps
        del st, state, ck, cv
    del keys, values
    torch.cuda.empty_cache()
json.dump(results, open(sys.argv[1], "w"), indent=1)
# registers and spills of every compiled kernel
import triton, importlib
mods = ["oa_plugins.kernels.flash", "oa_plugins.kernels.flash_step", "oa_core.selection", "oa_plugins.selectors.qgs", "oa_core.cluster_stats"]
for m in mods:
    mod = importlib.import_module(m)
    for name in dir(mod):
        fn = getattr(mod, name)
        if isinstance(fn, triton.runtime.jit.JITFunction):
            for dev_key, caches in getattr(fn, "device_caches", {}).items():
                for key, kern in caches[0].items():
                    try:
                        kern._init_handles()
                        print("REGS", m.split(".")[-1], name, "warps", kern.metadata.num_warps, "stages", kern.metadata.num_stages, "regs", kern.n_regs, "spills", kern.n_spills)
                    except Exception as e:
                        print("REGS", name, "?", e)
