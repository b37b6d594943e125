"""The GPU's eigensolver on real queries: does the subspace iteration (``oa_core.ops.geometry.subspace_eigenpairs``,
what CUDA runs) give LAPACK's top-16 eigenpairs on the query moments of a real model, and the same QGC clusters?

The offline model (SmolLM2) reads two texts — the essay haystack, and the text of a module of Python's standard
library (not tuned on: any text will do) — and every layer's last 256 prefill queries give one moment per KV head.
Per layer: products until convergence, the top-16 eigenvalues' relative error, the largest residual ‖Mu − λu‖/λ_1,
the captured variance against LAPACK's, and QGC's assignment with each basis (the share of keys in the same
cluster, clusters matched by their members). Runs on the CPU (the iteration's orthonormalisation is QR there, the
Triton Gram–Schmidt on CUDA: the same span). Writes ``benchmarks/studies/results/geometry_real_queries.json``.

    python benchmarks/studies/geometry_real_queries.py
    python benchmarks/studies/geometry_real_queries.py --tokens 2048 --layers 0 7 15
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import torch

from oa_core.analysis.attention_error import haystack_ids
from oa_core.analysis.offline_model import capture_attention, load_offline_model
from oa_core.ops import geometry, kmeans

RANK, WINDOW, CLUSTERS = 16, 256, 64


def same_clusters(a: torch.Tensor, b: torch.Tensor, clusters: int) -> float:
    """Share of points whose cluster in ``b`` is the one most of their ``a``-cluster went to (labels may differ)."""
    agree = 0
    for c in range(clusters):
        members = b[a == c]
        if members.numel():
            agree += int(members.bincount().max())
    return agree / a.numel()


def layer_figures(queries: torch.Tensor, keys: torch.Tensor) -> dict:
    B, Hkv, N, D = keys.shape
    samples = queries[:, :, -WINDOW:].double().reshape(B, Hkv, -1, D)
    moment = samples.transpose(-1, -2) @ samples / samples.shape[2]
    exact_values, exact_vectors = torch.linalg.eigh(moment)
    products = []
    real = geometry.orthonormalize
    with mock.patch.object(geometry, "orthonormalize", lambda x, **kw: products.append(1) or real(x, **kw)):
        values, vectors = geometry.subspace_eigenpairs(moment, RANK)
    top = exact_values[..., -RANK:]
    residual = (moment @ vectors - vectors * values[..., None, :]).norm(dim=-2) / exact_values[..., -1:]
    captured = values.sum(-1) / top.sum(-1)
    # QGC's clusters with each basis (k-means in Φ = K U_r Λ_r^½, the same seed).
    mask = torch.ones(B, Hkv, N, dtype=torch.bool)
    assignments = []
    for u, lam in ((exact_vectors[..., -RANK:], top), (vectors, values)):
        points = keys.float() @ (u * lam.clamp_min(0).sqrt()[..., None, :]).float()
        assignments.append(kmeans.lloyd(points, mask, CLUSTERS, 20, torch.Generator().manual_seed(0))[0])
    return {
        "products": len(products) - 1,
        "gap_16_33": float((exact_values[..., -2 * RANK - 1] / exact_values[..., -RANK]).max()),
        "value_rel_error": float(((values - top).abs() / exact_values[..., -1:]).max()),
        "residual_over_lambda1": float(residual.max()),
        "captured_variance_ratio_min": float(captured.min()),
        "same_cluster_share": min(
            same_clusters(a, b, CLUSTERS) for a, b in zip(assignments[0].reshape(-1, N), assignments[1].reshape(-1, N))
        ),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (default: %(default)s)")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="default: every layer")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "geometry_real_queries.json")
    args = parser.parse_args(argv)
    model, tokenizer = load_offline_model()
    layers = args.layers if args.layers is not None else list(range(model.config.num_hidden_layers))
    record = {
        "model": "SmolLM2 (offline)",
        "rank": RANK,
        "window": WINDOW,
        "clusters": CLUSTERS,
        "tokens": args.tokens,
        "texts": {},
    }
    for name, ids in (
        ("essays", haystack_ids(tokenizer, args.tokens)),
        ("python-stdlib", haystack_ids(tokenizer, args.tokens, "python-source")),
    ):
        captured = capture_attention(model, ids, layers)
        rows = {layer: layer_figures(captured[layer].queries, captured[layer].keys) for layer in layers}
        record["texts"][name] = rows
        worst = {
            k: (max if k not in ("captured_variance_ratio_min", "same_cluster_share") else min)(
                r[k] for r in rows.values()
            )
            for k in next(iter(rows.values()))
        }
        print(
            f"{name}: over {len(layers)} layers, worst: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()),
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
