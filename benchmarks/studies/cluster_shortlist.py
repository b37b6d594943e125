"""Issue 56 in CUDA: PQS's scores and each head's shortlist cut in one launch, the scores kept on chip (GPU only).

Triton cannot keep a (batch row, KV head)'s scores on chip: at 16K positions its G = 4 heads' scores are 256 KB, more
than an SM's shared memory, and Triton has no barrier between the programs that would share them. A thread-block
cluster (sm_90) can: ``cluster_shortlist.cu`` gives each (batch row, KV head) a cluster of CL blocks, each keeping its
part of the scores in shared memory, and cuts each head's shortlist by a radix select whose histograms the blocks
read from each other (distributed shared memory) between cluster barriers. Nothing but the k positions is written.

With a selection, the same launch then takes each head's q_b best positions in every cluster b from the same on-chip
keys (the step's per-cluster selection), for random clusters and quotas.

Timed here, on random codes and tables of the Llama-3.1-8B shape (8 KV heads, 4 query heads each, head dim 128 as 64
two-dimensional sub-spaces of 16 centroids), in the same run:
- ``triton_scores``: Triton's ``group_lut_scores`` (the scores the composed step writes);
- ``triton_scores_topk``: those scores and ``torch.topk`` of each head's k (a shortlist the composed way);
- ``cuda_scores``: the same scores from a CUDA kernel with the tables in shared memory (``lut_scores``);
- ``triton_selection``: the step's per-cluster selection (``select_per_cluster``, `_select_kernel`) over those scores;
- ``cluster_shortlist``: the one launch, per cluster size CL that fits; the same launch with the per-cluster
  selection by radix passes over every key (``..._by_radix``), and from candidates: each block's min(q_b, its members)
  best keys of a (head, cluster) pair gathered to the pair's owner block, which takes the q_b best
  (``..._from_candidates``), and at owner blocks: every key of a pair sent to its owner, which selects by a radix
  select of 8-bit digits in its own shared memory (``..._at_owners``).

k is the default's shortlist: rerank 4 × the selectable budget (density × N − sink 4 − local 64), at 1% and 3%.
Checks: the CUDA scores against Triton's (largest difference; the sums run in another order), and each cluster
shortlist against ``torch.topk`` of the CUDA kernel's own scores (the same arithmetic): the same multiset of scores;
each selection (Triton's and the cluster's) against a torch reference on its own scores: the same (cluster, score)
pairs, and every slot up to Σ_b q_b written.
Writes ``benchmarks/studies/results/cluster_shortlist_<gpu>.json``.

    python benchmarks/studies/cluster_shortlist.py            # on a CUDA device with nvcc (sm_90)
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "cluster_shortlist.cu"
HKV, G, M, CC, C = 8, 4, 64, 16, 64  # C: clusters (QGC's default), as cluster_shortlist.cu has them
SINK, LOCAL, RERANK = 4, 64, 4
SMEM_LIMIT = 227 * 1024  # an sm_90 block's most dynamic shared memory
NULL = ctypes.c_void_p(None)
# cluster_shortlist.cu's methods: the shortlist alone; with the per-cluster selection by radix passes over every key;
# with the selection from each block's best candidates, gathered to an owner block per (head, cluster) pair; with the
# selection at owner blocks, which receive every key of their pairs and select in their own shared memory
METHODS = (
    "cluster_shortlist",
    "cluster_shortlist_and_selection_by_radix",
    "cluster_shortlist_and_selection_from_candidates",
    "cluster_shortlist_and_selection_at_owners",
)


def build(cache: Path) -> ctypes.CDLL:
    """``cluster_shortlist.cu`` compiled by nvcc for sm_90a into ``cache`` (once per source) and loaded."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    library = cache / f"cluster_shortlist_{digest}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        command = ["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90a,code=sm_90a"]
        subprocess.run([*command, str(SOURCE), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.cluster_shortlist_smem.restype = ctypes.c_size_t
    return lib


def result_path(study: str, out: Path | None) -> Path:
    """``out``, else ``results/<study>_<gpu>.json`` beside the studies (h100, h200, ...); its folder made."""
    path = out or HERE / "results" / f"{study}_{torch.cuda.get_device_name().split()[1].lower()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def pointer(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def stream() -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def checked(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: CUDA error {code}")


def timed(fn) -> dict[str, float]:
    """Median milliseconds, launched as a user calls it and replayed from a CUDA graph."""
    import triton.testing

    return {
        "eager_ms": round(triton.testing.do_bench(fn, return_mode="median"), 4),
        "graph_ms": round(triton.testing.do_bench_cudagraph(fn, return_mode="median"), 4),
    }


def selection_inputs(batch: int, context: int, density: float, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A random clustering and per-cluster quotas: assignment ``[B, Hkv, N]`` uint8 (every position in one of C
    clusters), quotas ``[B, Hkv, G, C]`` int32 near each cluster's share of the selectable budget (×0–2), at most its
    size, with cluster 0 taken whole and cluster 1 not at all; and the width Σ_b q_b of the fullest row. (The
    clusters' sizes: ``cluster_sizes``.)"""
    assignment = torch.randint(0, C, (batch, HKV, context), dtype=torch.uint8, device=device)
    sizes = cluster_sizes(assignment)
    budget = density * context - SINK - LOCAL
    share = sizes[:, :, None, :].double() / context * budget * 2 * torch.rand(batch, HKV, G, C, device=device)
    quotas = torch.minimum(share.round().long(), sizes[:, :, None, :])
    quotas[..., 0], quotas[..., 1] = sizes[:, :, None, 0], 0
    return assignment, quotas.int().contiguous(), int(quotas.sum(-1).max())


def cluster_sizes(assignment: torch.Tensor) -> torch.Tensor:
    """assignment ``[..., N]`` (cluster ids below C) → each cluster's members ``[..., C]`` int64."""
    sizes = torch.zeros(*assignment.shape[:-1], C, dtype=torch.long, device=assignment.device)
    return sizes.scatter_add_(-1, assignment.long(), torch.ones_like(assignment, dtype=torch.long))


def reference_selection(scores: torch.Tensor, assignment: torch.Tensor, quotas: torch.Tensor, width: int):
    """Each (row, head)'s selected (cluster, score) pairs as ``cluster · 1000 + score`` (scores here are far below
    1000 in size), sorted, +inf past Σ_b q_b: the multiset a correct per-cluster top-q gives, whatever the ties."""
    s = scores.double()
    a = assignment.long()[:, :, None, :].expand_as(s)
    order = (a * 1000 - s).argsort(dim=-1, stable=True)  # by cluster, best first
    cluster = a.gather(-1, order)
    sizes = cluster_sizes(a)
    starts = sizes.cumsum(-1) - sizes
    rank = torch.arange(s.shape[-1], device=s.device) - starts.gather(-1, cluster)
    keep = rank < quotas.long().gather(-1, cluster)
    combined = (a * 1000 + s).gather(-1, order)
    return torch.where(keep, combined, math.inf).sort(dim=-1).values[..., :width]


def run_config(lib, batch: int, context: int, density: float, clusters: list[int]) -> dict:
    from oa_core.ops.selection import cluster_members, select_per_cluster
    from oa_plugins.selectors.pq import group_lut_scores

    torch.manual_seed(0)
    device = torch.device("cuda")
    BH, N = batch * HKV, context
    k = math.ceil(RERANK * (density * N - SINK - LOCAL))
    tables = torch.randn(batch, HKV, G, M, CC, device=device)
    codes = torch.randint(0, 256, (batch, HKV, N, M // 2), dtype=torch.uint8, device=device)
    assignment, quotas, width = selection_inputs(batch, context, density, device)
    triton_out = torch.empty(batch, HKV, G, N, device=device)
    cuda_out = torch.empty(batch, HKV, G, N, device=device)
    members = cluster_members(assignment.long(), C)

    def triton_scores():
        group_lut_scores(tables, codes, 1.0, 1, 1, out=triton_out)

    def triton_scores_topk():
        triton_scores()
        return triton_out.topk(k, dim=-1, sorted=False)

    def triton_selection():  # the step's per-cluster selection (`_select_kernel`) over scores in memory
        return select_per_cluster(triton_out[:, :, :, None], *members, quotas[:, :, :, None], width)

    def cuda_scores():
        checked(lib.launch_lut_scores(pointer(tables), pointer(codes), pointer(cuda_out), BH, N, 1024, stream()), "lut")

    triton_scores()
    cuda_scores()
    torch.cuda.synchronize()
    row = {
        "batch": batch,
        "context": context,
        "density": density,
        "k": k,
        "selection_width": width,
        "scores_max_abs_diff": float((triton_out - cuda_out).abs().max()),
        "triton_scores": timed(triton_scores),
        "triton_scores_topk": timed(triton_scores_topk),
        "triton_selection": timed(triton_selection),
        "cuda_scores": timed(cuda_scores),
        **{key: {} for key in METHODS},
    }
    # The reference's selection checks Triton's (on Triton's scores) as well as the cluster's (on its own).
    combined = assignment.long()[:, :, None, :] * 1000 + triton_out.double()
    taken = triton_selection().view(batch, HKV, G, width)
    picked = torch.where(taken >= 0, combined.gather(-1, taken.clamp_min(0)), math.inf).sort(dim=-1).values
    row["triton_selection_same_as_reference"] = bool(
        torch.equal(picked, reference_selection(triton_out, assignment, quotas, width))
    )
    best = cuda_out.topk(k, dim=-1).values.sort(dim=-1).values
    chosen = reference_selection(cuda_out, assignment, quotas, width)
    wanted = quotas.sum(-1, keepdim=True)
    sizes = cluster_sizes(assignment).view(BH, C)
    pair_quotas = quotas.long().view(BH, G * C)
    picked_among = (pair_quotas > 0) & (pair_quotas < sizes.repeat(1, G))  # pairs selected from candidates
    for method, key in enumerate(METHODS):
        select = method > 0
        for cl in clusters:
            found = row[key]
            if method == 2:  # room for CL · q_b candidates of each pair selected among, per owner block
                capacity = int((cl * pair_quotas * picked_among).view(BH, G * C // cl, cl).sum(1).max())
            elif method == 3:  # room for every key of the pairs an owner block owns
                capacity = int(sizes.repeat(1, G).view(BH, G * C // cl, cl).sum(1).max())
            else:
                capacity = 0
            smem = lib.cluster_shortlist_smem(N, cl, method, capacity)
            if smem > SMEM_LIMIT:
                found[cl] = {"skipped": f"{smem} bytes of shared memory a block"}
                continue
            listed = torch.full((batch, HKV, G, k), -1, dtype=torch.int32, device=device)
            cuts = torch.empty(batch, HKV, G, dtype=torch.int32, device=device)
            selected = torch.full((batch, HKV, G, width), -1, dtype=torch.int32, device=device)

            def launch(
                listed=listed, cuts=cuts, selected=selected, cl=cl, select=select, method=method, capacity=capacity
            ):
                code = lib.launch_cluster_shortlist(
                    pointer(tables),
                    pointer(codes),
                    BH,
                    N,
                    k,
                    cl,
                    pointer(listed),
                    pointer(cuts),
                    pointer(assignment) if select else NULL,
                    pointer(quotas) if select else NULL,
                    width,
                    pointer(selected) if select else NULL,
                    method,
                    capacity,
                    stream(),
                )
                checked(code, f"cluster_shortlist (CL {cl}, method {method})")

            try:
                launch()
                torch.cuda.synchronize()
            except RuntimeError as exc:  # a launch the device refuses (a cluster no GPC holds): said, not fatal
                found[cl] = {"shared_memory_bytes": smem, "error": str(exc)[:300]}
                continue
            filled = bool((listed >= 0).all())
            distinct = bool((listed.sort(dim=-1).values.diff(dim=-1) > 0).all()) if filled else False
            same = filled and bool(torch.equal(cuda_out.gather(-1, listed.long()).sort(dim=-1).values, best))
            found[cl] = {
                "shared_memory_bytes": smem,
                **({"room": capacity} if method >= 2 else {}),
                "every_slot_written": filled,
                "positions_distinct": distinct,
                "same_scores_as_topk": same,
            }
            if select:
                written = selected >= 0
                slots = torch.arange(width, device=device)
                combined = assignment.long()[:, :, None, :] * 1000 + cuda_out.double()
                picked = torch.where(written, combined.gather(-1, selected.long().clamp_min(0)), math.inf)
                found[cl]["selection_slots_written"] = bool(torch.equal(written, slots < wanted))
                found[cl]["same_selection_as_reference"] = bool(torch.equal(picked.sort(dim=-1).values, chosen))
            found[cl].update(timed(launch))
    return row


def verdict(found: dict) -> str:
    """A cluster size's outcome in a word or a reason."""
    if "skipped" in found or "error" in found:
        return found.get("skipped") or found["error"]
    said = "same as topk" if found["same_scores_as_topk"] else "DIFFERS from topk"
    if "same_selection_as_reference" in found:
        same = found["same_selection_as_reference"] and found["selection_slots_written"]
        said += ", selection " + ("as the reference's" if same else "DIFFERS from the reference")
    return said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["16x16384", "32x32768", "2x131072"])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.03])
    parser.add_argument("--clusters", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/oa_cuda_studies"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("cluster_shortlist: needs a CUDA device of compute capability 9.0 (thread-block clusters)")
        return 1
    from oa_core.analysis.provenance import provenance

    lib = build(args.cache)
    out = result_path("cluster_shortlist", args.out)
    rows: list[dict] = []
    result = {
        "what": __doc__.split("\n\n")[0],
        "shape": {"kv_heads": HKV, "group": G, "sub_spaces": M, "centroids": CC, "rerank": RERANK},
        "runs": rows,
        "provenance": provenance("cuda"),
    }
    for config in args.configs:
        batch, context = (int(x) for x in config.split("x"))
        for density in args.densities:
            row = run_config(lib, batch, context, density, args.clusters)
            rows.append(row)
            best, radix, candidates, owners = (
                min(((v["graph_ms"], cl) for cl, v in row[key].items() if "graph_ms" in v), default=(math.nan, None))
                for key in METHODS
            )
            print(
                f"{batch:>3} × {context:>6} {density:>4.0%} k {row['k']:>5}: graphed ms — Triton scores "
                f"{row['triton_scores']['graph_ms']:.3f}, + topk {row['triton_scores_topk']['graph_ms']:.3f}, "
                f"selection {row['triton_selection']['graph_ms']:.3f}; CUDA scores "
                f"{row['cuda_scores']['graph_ms']:.3f}; cluster shortlist {best[0]:.3f} (CL {best[1]}), with the "
                f"selection by radix {radix[0]:.3f} (CL {radix[1]}), from candidates {candidates[0]:.3f} "
                f"(CL {candidates[1]}), at owners {owners[0]:.3f} (CL {owners[1]}); scores differ by ≤ "
                f"{row['scores_max_abs_diff']:.1e}; "
                + "; ".join(
                    f"{key[18:] or 'shortlist'} CL {cl}: {verdict(v)}" for key in METHODS for cl, v in row[key].items()
                )
            )
            out.write_text(json.dumps(result, indent=1) + "\n")  # after each row: a fault later keeps these
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
