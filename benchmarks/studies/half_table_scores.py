"""Would PQS's scores cost less on the GPU from 16-bit tables, two query heads a shared-memory word? (GPU only)

The CUDA shortlist's scores (``plugins/kernels/pq_shortlist.cu``, phase 1) read one float32 table entry a sub-space
and query head; each warp's read is one shared-memory wavefront, and the scores are bound by them (0.50 ms of the
shortlist's 1.00 at 32 × 32K and 1% per head on an H200: ``docs/results.md``). ``shared_shortlist_recall.py`` found
that float16 tables keep the rows float32 ones keep, on both offline models. Here ``half_table_scores.cu`` times four
forms of the same scores — float32 tables (the step's), float16 tables summed in float32, float16 tables summed in
float16, bfloat16 tables summed in float32 — on random tables and codes of the Llama-3.1-8B shape (8 KV heads, 4 query
heads each, 64 sub-spaces of 16 centroids), and checks each against torch doing the same arithmetic in the same order
(the largest difference: 0 where the two agree bit for bit), and each 16-bit form's top 4% (the default's shortlist
at 1%: rerank 4) against float32's: the share of positions both keep, mean and lowest over the (row, head) pairs.
Writes ``benchmarks/studies/results/half_table_scores_<gpu>.json``.

    python benchmarks/studies/half_table_scores.py          # on a CUDA device with nvcc
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_shortlist import checked, pointer, result_path, stream, timed

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "half_table_scores.cu"
HKV, G, M, CC = 8, 4, 64, 16
FORMS = ["float32 tables", "float16 tables, float32 sums", "float16 sums", "bfloat16 tables, float32 sums"]
CHUNK = 1024  # keys a block
SHORTLIST = 0.04  # the share of positions compared between forms


def build(cache: Path, source: Path = SOURCE) -> ctypes.CDLL:
    """``source`` compiled by nvcc for the device into ``cache`` (once per source) and loaded."""
    from oa_plugins.kernels.pq_shortlist_cuda import nvcc

    compiler = nvcc()
    if compiler is None:
        raise SystemExit(f"{source.stem}: no nvcc")
    major, minor = torch.cuda.get_device_capability()
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    library = cache / f"{source.stem}_{digest}_sm{major}{minor}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        arch = f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
        command = [compiler, "-O3", "-shared", "-Xcompiler", "-fPIC", arch, str(source), "-o", str(library)]
        subprocess.run(command, check=True)
    return ctypes.CDLL(str(library))


def packed_tables(tables: torch.Tensor, form: int) -> torch.Tensor:
    """``[BH, G, M, CC]`` float32 → the form's layout: float32 as is; 16-bit ``[BH, G/2, M, CC, 2]`` (heads 2p and
    2p + 1 in one word, 2p in the low half)."""
    if form == 0:
        return tables.contiguous()
    dtype = torch.bfloat16 if form == 3 else torch.float16
    BH = tables.shape[0]
    return tables.to(dtype).view(BH, G // 2, 2, M, CC).permute(0, 1, 3, 4, 2).contiguous()


def reference(tables: torch.Tensor, codes: torch.Tensor, form: int) -> torch.Tensor:
    """Torch's scores ``[BH, G, N]`` for a form: the same rounding and the same order of sums as the kernel's."""
    BH, N = codes.shape[:2]
    nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).view(BH, 1, N, M).long().expand(BH, G, N, M)
    entries = {0: tables, 1: tables.half().float(), 2: tables.half(), 3: tables.bfloat16().float()}[form]
    total = torch.zeros(BH, G, N, dtype=entries.dtype, device=tables.device)
    for m in range(M):
        total = total + entries[:, :, m, :].gather(-1, nibbles[..., m])
    return total.float()


def kept(scores: torch.Tensor, baseline: torch.Tensor) -> tuple[float, float]:
    """The share of baseline's top SHORTLIST positions that ``scores``' top SHORTLIST also holds: mean and lowest."""
    k = max(1, round(SHORTLIST * scores.shape[-1]))
    ours = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(k, dim=-1).indices, True)
    theirs = baseline.topk(k, dim=-1).indices
    share = ours.gather(-1, theirs).float().mean(-1)
    return float(share.mean()), float(share.min())


def run_config(lib, batch: int, context: int) -> dict:
    torch.manual_seed(0)
    BH, N = batch * HKV, context
    tables = torch.randn(BH, G, M, CC, device="cuda")
    codes = torch.randint(0, 256, (BH, N, M // 2), dtype=torch.uint8, device="cuda")
    row: dict = {"batch": batch, "context": context, "forms": {}}
    outputs = {}
    for form, name in enumerate(FORMS):
        packed = packed_tables(tables, form)
        out = torch.empty(BH, G, N, device="cuda")

        def launch(packed=packed, out=out, form=form, name=name):
            code = lib.launch_scores(form, pointer(packed), pointer(codes), pointer(out), BH, N, CHUNK, stream())
            checked(code, name)

        launch()
        torch.cuda.synchronize()
        outputs[form] = out
        found = {"max_abs_diff_from_torch": float((out - reference(tables, codes, form)).abs().max()), **timed(launch)}
        if form:
            found["top4pct_kept_mean"], found["top4pct_kept_lowest"] = kept(out, outputs[0])
        row["forms"][name] = found
    return row


def run_study(study: str, doc: str, source: Path, forms: list[str], run_config, argv: list[str] | None) -> int:
    """A scores study's command line (this one's and ``wide_code_scores.py``'s): ``run_config(lib, batch, context)``
    at each ``--configs``, printed form by form and written to ``results/<study>_<gpu>.json`` after each."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["16x16384", "32x32768", "2x131072"])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/oa_cuda_studies"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{study}: needs a CUDA device")
        return 1
    from oa_core.analysis.provenance import provenance

    lib, out, rows = build(args.cache, source), result_path(study, args.out), []
    result = {"what": doc.split("\n\n")[0], "forms": forms, "runs": rows, "provenance": provenance("cuda")}
    for config in args.configs:
        batch, context = (int(x) for x in config.split("x"))
        row = run_config(lib, batch, context)
        rows.append(row)
        for name, f in row["forms"].items():
            kept_note = ""
            if "top4pct_kept_mean" in f:
                kept_note = f", top 4% kept {f['top4pct_kept_mean']:.4f} (lowest {f['top4pct_kept_lowest']:.3f})"
            print(
                f"{batch:>3} × {context:>6} {name}: {f['graph_ms']:.3f} ms graphed ({f['eager_ms']:.3f} eager), "
                f"≠ torch by {f['max_abs_diff_from_torch']:.1e}{kept_note}"
            )
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_study("half_table_scores", __doc__, SOURCE, FORMS, run_config, argv)


if __name__ == "__main__":
    sys.exit(main())
