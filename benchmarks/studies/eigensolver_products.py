"""How many products the GPU's eigensolver (``oa_core.ops.geometry.subspace_eigenpairs``) takes, stopped by the residual
alone (``energy_tol=0``) and by default (the residual, or the captured query energy settling), on the benchmark's
eigensolver case: 128 × 128 moments of 1024 samples with a flat spectrum (random weights' queries, the worst case)
and a decaying one (0.9^i). Counted on the CPU (the iteration's orthonormalisation is QR there, the Triton
Gram–Schmidt on CUDA: the same span); the time on a GPU is about the count times one product's cost. Writes
``benchmarks/studies/results/eigensolver_products.json``.

    python benchmarks/studies/eigensolver_products.py
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import torch

from oa_core.ops import geometry

ROOT = Path(__file__).resolve().parents[2]
D, RANK, SAMPLES, MATRICES = 128, 16, 1024, 32


def count(moment: torch.Tensor, **kwargs) -> dict:
    calls = []
    real = geometry.orthonormalize
    with mock.patch.object(geometry, "orthonormalize", lambda x, **kw: calls.append(1) or real(x, **kw)):
        values, vectors = geometry.subspace_eigenpairs(moment, RANK, **kwargs)
    exact = torch.linalg.eigh(moment).eigenvalues
    captured = (vectors.transpose(-1, -2) @ moment @ vectors).diagonal(dim1=-2, dim2=-1).sum(-1)
    residual = (moment @ vectors - vectors * values[..., None, :]).norm(dim=-2) / exact[..., -1:]
    return {
        "products": len(calls) - 1,  # the first call orthonormalises the start
        "energy_short_of_exact_max": float((1 - captured / exact[..., -RANK:].sum(-1)).max()),
        "value_rel_error_max": float(((values - exact[..., -RANK:]).abs() / exact[..., -1:]).max()),
        "residual_over_lambda1_max": float(residual.max()),
    }


def main() -> int:
    gen = torch.Generator().manual_seed(1)
    out = {"matrices": MATRICES, "dim": D, "rank": RANK, "samples": SAMPLES, "spectra": {}}
    for name, spectrum in (
        ("flat", torch.ones(D, dtype=torch.float64)),
        ("decaying", 0.9 ** torch.arange(D, dtype=torch.float64)),
    ):
        samples = torch.randn(MATRICES, SAMPLES, D, generator=gen, dtype=torch.float64) * spectrum.sqrt()
        moment = samples.transpose(-1, -2) @ samples / SAMPLES
        out["spectra"][name] = {"residual_only": count(moment, energy_tol=0.0), "default": count(moment)}
        print(name, json.dumps(out["spectra"][name]))
    path = ROOT / "benchmarks" / "studies" / "results" / "eigensolver_products.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
