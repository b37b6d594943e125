"""Does PQS's prepare cost less on the GPU in two launches of its own than on the shared k-means kernels, and does it
learn centroids as good? (GPU only)

The default's prepare took 24.6% of the model's prefill in ``generate`` on an H200 (16 × 16K, 126b6c4), the paper's
pipeline 8.4%: the difference is PQS's index — every (batch row, KV head, sub-space) a k-means of 16 centroids over
4096 training keys' two coordinates, then every key's 64 codes. On the shared kernels (``oa_core.ops.kmeans``, made
for QGC's 64 clusters of 16 dimensions) that is a Lloyd launch a round with each point padded to 16 dimensions, the
training points and every key copied to float32 sub-space by sub-space, and the codes taken through int64 argmins;
``oa_plugins.selectors.pq_programs`` does it in one launch for the k-means (the centroids in registers, the points read
from the keys) and one for the codes.

Per batch × context, Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head dim 128), random bf16 keys,
values and 256 prefill queries, the default spec (``specs/openattention.yaml``) at 1%: PQS's ``build`` and the whole
``Pipeline.prepare`` timed both ways (median of ``--repeats``, the device synchronised around each); the two indices
compared: the largest centroid difference, the share of codes equal, and each one's quantisation error (the mean over
keys of ‖k − its codes' centroids‖² / ‖k‖²: lower is better). Writes ``results/pq_prepare_<gpu>.json``.

    python benchmarks/studies/pq_prepare_speed.py --configs 16x16384 8x32768 1x32768
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import oa_core as oa
from cluster_shortlist import result_path
from oa_core.components import Clusters
from oa_plugins.selectors import pq
from prepare_speed import timed

SPEC = Path(__file__).resolve().parents[2] / "specs" / "openattention.yaml"
HQ, HKV, D = 32, 8, 128


def shared_kernels(fn):
    """``fn`` run with PQS on the shared k-means kernels (``pq.on_gpu`` false: ``lloyd_iterations`` and ``nearest``,
    which take their own Triton kernels on CUDA tensors)."""

    def run():
        kept, pq.on_gpu = pq.on_gpu, lambda tensor: False
        try:
            return fn()
        finally:
            pq.on_gpu = kept

    return run


def quantisation_error(keys: torch.Tensor, index: pq.PQSIndex) -> float:
    """Mean over keys of ‖k − its codes' centroids‖² / ‖k‖²."""
    B, Hkv, M, C, dims = index.centroids.shape
    codes = (pq.unpack_codes(index.codes, M) if pq.packed(C) else index.codes).long().permute(0, 1, 3, 2)
    picked = index.centroids.gather(3, codes[..., None].expand(*codes.shape, dims))  # [B, Hkv, M, N, dims]
    rebuilt = picked.permute(0, 1, 3, 2, 4).reshape(B, Hkv, -1, M * dims)
    k = keys.float()
    return float(((k - rebuilt).square().sum(-1) / k.square().sum(-1).clamp_min(1e-12)).mean())


def run_config(batch: int, context: int, repeats: int) -> dict:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(batch, HKV, context, D, device=device, generator=gen, dtype=torch.bfloat16)
    values = torch.randn(batch, HKV, context, D, device=device, generator=gen, dtype=torch.bfloat16)
    prefill = torch.randn(batch, HQ, 256, D, device=device, generator=gen, dtype=torch.bfloat16)
    pipe = oa.build({**oa.load_spec(SPEC).model_dump(mode="json"), "budget": {"density": 0.01}})
    assignment = torch.zeros(batch, HKV, context, dtype=torch.long, device=device)
    assignment[:, :, : pipe.spec.sink] = assignment[:, :, context - pipe.spec.local :] = 64  # outside the clusters
    clusters = Clusters(assignment, 64)
    row: dict = {"batch": batch, "context": context}
    build = lambda: pipe.selector.build(keys, None, clusters)  # noqa: E731
    prepare = lambda: pipe.prepare(keys, values, prefill.clone(), D**-0.5)  # noqa: E731
    build(), prepare()  # kernels compiled, the allocator primed
    own, row["build_ms"] = timed(build, repeats)
    shared_kernels(build)(), shared_kernels(prepare)()
    shared, row["build_shared_kernels_ms"] = timed(shared_kernels(build), repeats)
    _, row["prepare_ms"] = timed(prepare, repeats)
    _, row["prepare_shared_kernels_ms"] = timed(shared_kernels(prepare), repeats)
    row["centroids_max_difference"] = float((own.centroids - shared.centroids).abs().max())
    row["codes_equal"] = round(float((own.codes == shared.codes).float().mean()), 6)
    row["quantisation_error"] = round(quantisation_error(keys, own), 6)
    row["quantisation_error_shared_kernels"] = round(quantisation_error(keys, shared), 6)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["16x16384", "8x32768", "1x32768"], help="batch x context")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this study needs a CUDA device", file=sys.stderr)
        return 2
    from oa_core.analysis.provenance import provenance

    out = result_path("pq_prepare", args.out)
    record = {"what": __doc__.split("\n\n")[0], "spec": str(SPEC.name), "runs": [], "provenance": provenance("cuda")}
    for config in args.configs:
        batch, context = (int(x) for x in config.lower().split("x"))
        row = run_config(batch, context, args.repeats)
        record["runs"].append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        torch.cuda.empty_cache()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
