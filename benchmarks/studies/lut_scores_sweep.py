"""Which launch suits PQS's table-lookup scores (``group_lut_scores``) on the GPU: keys per program and warps?
(Its first run, at 73c848f, also compared the query heads of a shared selection unrolled or looped and the tables
gathered from memory: the tables in registers won, and the others were dropped.)

At the Llama-3.1-8B shape (8 KV heads, 4 query heads each, head dim 128: 64 sub-spaces of 16 centroids), batch
16 × 16K, per head (4 selection rows of one head each) and shared (one row, the maximum over 4 heads): each launch's
median in a CUDA graph, beside dense SDPA decode attention over the same cache, and its bytes: the codes two a byte,
as the index keeps them. The scores of every launch are checked against the first's.

    python benchmarks/studies/lut_scores_sweep.py                 # on the GPU: results/lut_scores_sweep_<gpu>.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from kernel_h200 import bench, graphed  # noqa: E402
from oa_core.analysis.provenance import provenance  # noqa: E402
from oa_plugins.selectors.pq import group_lut_scores, pack_codes  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    B, H, g, N, D, C = args.batch, 8, 4, args.context, 128, 16
    M = D // 2
    gen = torch.Generator(device=device).manual_seed(0)
    tables = torch.randn(B, H, g, M, C, device=device, generator=gen)
    codes = pack_codes(torch.randint(0, C, (B, H, N, M), device=device, generator=gen).to(torch.uint8))
    rows = []
    dense_ms = None
    if device.type == "cuda":
        q = torch.randn(B, H * g, 1, D, device=device, dtype=torch.bfloat16)
        k = torch.randn(B, H, N, D, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        dense_ms = bench(graphed(lambda: sdpa(q, k, v, enable_gqa=True)))
    for gqa, group in (("per_head", 1), ("shared", g)):
        first = None
        for block in args.blocks:
            for warps in args.warps:
                run = functools.partial(group_lut_scores, tables, codes, 0.1, 1, group, block_n=block, num_warps=warps)
                row = {"gqa": gqa, "block_n": block, "warps": warps}
                try:
                    out = run()
                    first = out if first is None else first
                    row["same"] = bool(torch.allclose(out, first, rtol=1e-5, atol=1e-5))
                    row["ms"] = bench(graphed(run)) if device.type == "cuda" else None
                except Exception as exc:  # a launch the compiler refuses: recorded, the sweep goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                print(rows[-1], flush=True)
    result = {
        "what": __doc__.split("\n\n")[0],
        "shape": {"batch": B, "kv_heads": H, "group": g, "context": N, "head_dim": D, "sub_spaces": M, "centroids": C},
        "codes_bytes": codes.numel(),
        "dense_sdpa_graph_ms": dense_ms,
        "runs": rows,
        "provenance": provenance(device),
    }
    name = torch.cuda.get_device_name().split()[1].lower() if device.type == "cuda" else "cpu"
    out = args.out or ROOT / "benchmarks/studies/results" / f"lut_scores_sweep_{name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
