"""The decode step's cost model (issue 56): what one layer's step reads from memory, part by part, against dense.

Per configuration (batch × context, density, ``gqa``) on the Llama-3.1-8B shape (32 query heads, 8 KV heads, head
dim 128, bf16 keys and values), for the default spec (``specs/openattention.yaml``: PQS, a re-ranked shortlist,
ErrorGate, second-order proxies), per (batch row, KV head) and then summed, in bytes:

- ``codes``: the selector's codes of every clusterable row (``Selector.scoring_bytes``: PQS's 4-bit codes packed two
  a byte, D/4 a key, as the index keeps them), read once for all the group's query heads;
- ``shortlist_keys``: the K rows of the shortlist re-scored by exact logits (⌈rerank × E_sel⌉ rows, D·2 bytes each),
  times the union factor of the group's shortlists;
- ``selected_rows``: K and V of the rows read exactly: sink and local window once for the group, the selected rows
  times the union factor of the group's selections — as issue 56's designs read them; the built steps' flash pass
  (``per_row``) reads each selection row's own rows, the sink and the window included (per head: G times a KV head);
- ``proxies``: each cluster's pooled sums (Σk, Σv, Σk⊙k for second-order proxies, the count) in float32, once for
  the group in the designs; in the built steps (``built_proxies``) Σk and Σk⊙k once for the group, by the prologue
  that turns them into each head's z̄_b and σ̂_b², and Σv, the count and those statistics once per selection row by
  the flash pass;
- ``state``: the step's growth and bookkeeping: the new row's codes, the leaving row's K and V and its cluster's sums
  (read and written), the cluster numbers of the shortlist's rows (int64, read by each selection row's plan for its
  own shortlist);
- ``members``: the clusters' member lists (int32 positions) that the per-cluster selection reads, one selection row
  at a time: at the bounds, every list, as if every cluster had a quota (one without is skipped, one whose quota
  covers it copied from its list) and the L2 held no row's lists for the next; with the measured factors, the share
  of the positions in clusters with a quota (``selection_reads``' ``member_lists``, ``selection_factors``);
- ``scores``: the selection scores' trips through memory, float32, one row per selection head (G per KV head with
  ``gqa: per_head``, 1 shared) over the clusterable positions, ``SCORE_PASSES`` times, and each listed position's box
  (``oa_core.ops.selection.listed_box``): an upper bound, as if the GPU's L2 held none of them (at 16 × 16K a layer's
  rows are 33 MB per head, within an H100's 50 MB of L2; at 32 × 32K, 134 MB, they are not). The last pass is the
  selection's, which gathers the scores of the clusters whose quota is partial through their member lists: with the
  measured factors, the share of a row's 32-byte sectors that hold such a position (``score_sectors``: a 4-byte read
  costs its sector), not the whole row.

A union factor is |∪_g rows of query head g| / (rows of one head): 1 when the group's heads read the same rows (always
so with ``gqa: shared``, one selection per group), G when they share none. With ``gqa: per_head`` the model states
both bounds, and — unless ``--no-measure`` — the factors measured on both offline models (essays, 8,176 tokens of
context on SmolLM2, 16,384 on Gemma-3-270M, the model's own queries at the next 16 positions, three layers; sink 4 and
local 16 as the accuracy benchmarks run), carried to the shape's group of 4 as the same share of the way from
agreeing heads to disjoint ones (SmolLM2's groups have 3 heads, Gemma-3-270M's 4). The selection's reads grow with
the budget (at 1% on Gemma-3-270M its member lists were 10% of the positions at 4K tokens and 28% at 16K), so at the
32K configurations, which take the factors measured at 8K and 16K, they are likely more than counted.

``launches``: the fused step's own count for the default (``FusedStep.launch_names``: six launches and one per
size class of clusters), at one size class — the selection takes one more launch per further class, which depends on
the largest cluster (``oa_core.ops.selection.size_classes``).

``one_program_projection``: the same bytes for issue 56's one-program design, which is not built (``projections``):
no row of scores goes through memory whole; each head keeps the candidates above a running threshold, written and
read once; the codes of clusters where a head's quota runs past its shortlisted rows are read again. Its shares are
measured on the same captures (``one_program_factors``). ``cluster_projection``: the bytes of the same step as one CUDA
thread-block cluster per (batch row, KV head), also not built: the scores stay in the blocks' shared memory from the
codes' one read to the flash pass, so none is written and no code is read twice, and the selection takes each
position's cluster from a one-byte id read once for the group instead of the member lists (``DESIGNS``; its scores
and cut on chip are timed by ``benchmarks/studies/cluster_shortlist.py``).

    python benchmarks/step_cost.py                 # writes benchmarks/results/step_cost.json
    python benchmarks/step_cost.py --no-measure    # the bounds only, no model loaded
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import oa_core as oa
from oa_core.analysis.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_cost_measure import (
    BUCKET_BITS,
    CHUNKS,
    MEASURE,
    SPEC,
    measure,
    transfer,
)

OUT = Path(__file__).resolve().parent / "results" / "step_cost.json"
# Llama-3.1-8B's attention: query heads, KV heads, head dim
SHAPE = {"model": "Llama-3.1-8B", "query_heads": 32, "kv_heads": 8, "head_dim": 128}
KV_SHAPE = (SHAPE["kv_heads"], SHAPE["head_dim"])  # step_bytes' kv_heads and head_dim
CONFIGS = [(16, 16384), (8, 32768), (32, 32768)]
DENSITIES = [0.01, 0.03]
KV_BYTES = 2  # bf16 keys and values
ASSIGNMENT_BYTES = 8  # a slot's cluster number (``StaticState.assignment``, int64)
MEMBER_BYTES = 4  # a member list's entry (``StaticState.members``, int32)
CLUSTER_ID_BYTES = 1  # a position's cluster as the cluster design would read it (at most 256 clusters: uint8)
# The default's fused step writes or reads a row of scores whole this many times: ``pq_scores`` writes it, ``pq_cut``
# reads it for two digits (the rest from the few keys near the cut), ``pq_list`` once (boxing the listed positions:
# counted apart, a write per shortlist entry), the selection reads its clusters' members (counted whole) and re-ranks
# the boxed scores as it reads them.
SCORE_PASSES = 5
# With the CUDA shortlist (``oa_plugins.kernels.pq_shortlist_cuda``, sm_90) a row of scores is written once, boxes in
# it, and read once by the selection; ``exact_logits`` then reads each selection row's listed K rows for that row
# alone (no union: the shortlist's K rows count G times per head). Since d1028e3 it no longer writes the boxes again:
# the boxes counted apart below are then an upper bound by one 4-byte write per shortlist entry.
CUDA_SCORE_PASSES = 2
PARTS = ("codes", "shortlist_keys", "selected_rows", "proxies", "state", "members", "scores")


def step_bytes(
    pipe: oa.Pipeline,
    batch: int,
    context: int,
    kv_heads: int,
    head_dim: int,
    shortlist_union: float = 1.0,
    selected_union: float = 1.0,
    group: int = SHAPE["query_heads"] // SHAPE["kv_heads"],
    candidates: float | None = None,
    reread: float = 0.0,
    score_passes: int = SCORE_PASSES,
    cluster_ids: bool = False,
    per_row: bool = False,
    selection_reads: tuple[float, float] = (1.0, 1.0),
) -> dict[str, float]:
    """Bytes one layer's decode step reads, by part, for ``batch`` rows of ``context`` tokens and ``group`` query
    heads per KV head (see the module's docstring); ``dense`` is what dense decoding reads (every K and V row
    once). With ``candidates`` (a share of the clusterable positions), the one-program design's instead: no row of
    scores goes through memory whole, each head's candidates are written and read once (a float32 score and an int32
    position each), and a share ``reread`` of the codes is read a second time (``one_program_factors``); with
    ``candidates=0``, the cluster design's: no score leaves the chip. ``score_passes``: the scores' trips whole (the
    CUDA shortlist's step: ``CUDA_SCORE_PASSES``). ``cluster_ids``: the selection reads each position's cluster as
    one byte, once for the group (the cluster design, its scores on chip in position order), not the member lists.
    ``per_row``: the flash pass as built (``sparse_pass``, a program per selection row and part): each selection row
    reads its own selected rows, the sink and the window, and the pooled sums of its KV head's clusters, whatever the
    group's heads share (the union factor of the selections unused). ``selection_reads``: the shares of a row's
    member lists and of its scores' bytes the per-cluster selection reads (``selection_factors``; 1, 1: every list and
    the whole row, the bound)."""
    spec, D = pipe.spec, head_dim
    fixed = min(spec.sink + spec.local, context)
    clusterable = context - fixed
    selectable = max(spec.budget.rows(context) - fixed, 0)
    multiple = getattr(pipe.selector.config, "rerank", 0.0) if pipe.selector.refines else 0.0
    shortlist = min(math.ceil(multiple * selectable), clusterable)
    codes = pipe.selector.scoring_bytes(D)
    if codes is None:
        raise ValueError(f"selector {pipe.selector.name!r} does not state its scoring bytes")
    clusters = min(getattr(pipe.clusterer.config, "num_clusters", 0), clusterable)
    score_rows = 1 if spec.gqa == "shared" else group
    sums = (3 if spec.proxy == "second-order" else 2) * D + 1  # float32 each
    row = 2 * D * KV_BYTES  # a K and a V row
    lists, scores_read = selection_reads
    per_head = {
        "codes": clusterable * codes * (1 + reread),
        "shortlist_keys": shortlist_union * shortlist * D * KV_BYTES,
        "selected_rows": (score_rows * (fixed + selectable) if per_row else fixed + selected_union * selectable) * row,
        "proxies": clusters * 4 * (built_proxies(D, group, score_rows, spec.proxy) if per_row else sums),
        "state": codes + row + 2 * sums * 4 + score_rows * shortlist * ASSIGNMENT_BYTES,
        "members": clusterable * CLUSTER_ID_BYTES if cluster_ids else score_rows * clusterable * MEMBER_BYTES * lists,
        # the passes (the selection's last, in part) and the boxes
        "scores": score_rows * (clusterable * (score_passes - 1 + scores_read) + shortlist) * 4,
    }
    if candidates is not None:
        per_head["scores"] = score_rows * clusterable * candidates * (4 + 4) * 2
    out = {part: batch * kv_heads * value for part, value in per_head.items()}
    out["total"] = sum(out.values())
    out["dense"] = batch * kv_heads * context * row
    return out


def built_proxies(head_dim: int, group: int, score_rows: int, proxy: str) -> int:
    """Float32 values per cluster and KV head that the built step reads and writes for its proxies: the prologue reads
    the cluster's count and Σk (and Σk⊙k for second-order proxies) once for the group and writes each query head's
    z̄_b and σ̂_b² (ErrorGate's statistics); each of the ``score_rows`` selection rows' flash pass reads the count, Σv
    and its heads' z̄_b (and σ̂_b²), not Σk nor Σk⊙k (``FlashKernel.sparse``'s ``logit_stats``)."""
    second = proxy == "second-order"
    statistics = (2 if second else 1) * head_dim + 1 + 2 * group
    return statistics + score_rows * (head_dim + 1) + (2 if second else 1) * group


def fused_launches(pipe: oa.Pipeline, cuda: bool = False) -> int:
    """The fused step's launches a layer for ``pipe``'s components, at one size class of clusters (``cuda``: with the
    CUDA shortlist)."""
    from oa_plugins.kernels.flash_step import SCORING, FusedStep

    rerank, floor = pipe.selector.config.rerank > 0, pipe.allocator.config.floor > 0
    return len(FusedStep.launch_names(SCORING[type(pipe.selector)], rerank, floor, classes=1, cuda=cuda))


def byte_fields(parts: dict[str, float]) -> dict:
    """``step_bytes``' result as a configuration's record fields: the parts, their total, dense's and the share."""
    return {
        "bytes": {k: round(v) for k, v in parts.items() if k not in ("total", "dense")},
        "total_bytes": round(parts["total"]),
        "dense_bytes": int(parts["dense"]),
        "share_of_dense": round(parts["total"] / parts["dense"], 4),
    }


def configs(pipe_for, measured: list[dict], cuda: bool = False) -> list[dict]:
    """Every built step's bytes: shared (union 1), and per head at both bounds and at each measured factor of the
    shortlists' union (the flash pass reads each selection row's own rows, ``per_row``, whatever the heads share).
    ``cuda``: the step with the CUDA shortlist (``CUDA_SCORE_PASSES``), which reads each row's shortlist for it."""
    G = SHAPE["query_heads"] // SHAPE["kv_heads"]
    rows = []
    for batch, context in CONFIGS:
        for density in DENSITIES:
            for gqa in ("per_head", "shared"):
                pipe = pipe_for(density, gqa)
                launches = fused_launches(pipe, cuda)
                # each case's union of the group's shortlists (Triton's listing reads a K row once for the rows
                # that list it); the flash pass reads each selection row's own rows whatever the heads share
                heads = G if gqa == "per_head" else 1.0
                bound = (1.0, 1.0)  # the selection reads every member list and the whole row of scores
                if gqa == "shared":
                    cases = {"shared": (1.0, bound)}
                else:
                    cases = {"heads agree": (1.0, bound), "heads disjoint": (G, bound)}
                    for m in measured:
                        found = m["densities"].get(str(density))
                        if found:  # the measured share of the way from agreeing to disjoint, on this shape's G
                            union = transfer(found["shortlist_union"], m["heads_per_group"], G)
                            reads = (
                                (found["member_lists"], found["score_sectors"]) if "member_lists" in found else bound
                            )
                            cases[f"measured on {m['model']}"] = (union, reads)
                for case, (short, reads) in cases.items():
                    passes, short = (CUDA_SCORE_PASSES, heads) if cuda else (SCORE_PASSES, short)
                    parts = step_bytes(
                        pipe,
                        batch,
                        context,
                        *KV_SHAPE,
                        short,
                        heads,
                        score_passes=passes,
                        per_row=True,
                        selection_reads=reads,
                    )
                    rows.append(
                        {
                            "batch": batch,
                            "context": context,
                            "density": density,
                            "gqa": gqa,
                            "overlap": case,
                            "shortlist_union": short,
                            "selected_union": heads,
                            "selection_reads": dict(zip(("member_lists", "score_sectors"), reads, strict=True)),
                            **byte_fields(parts),
                            "launches": launches,
                        }
                    )
    return rows


# Two designs of issue 56's step, projected (neither built):
# - "one program" (Triton): (1) per (batch row, KV head), the codes scored for every head of the group and each head's
#   candidates kept by a running threshold; (2) per (batch row, KV head), the exact cut from the candidates, the exact
#   logits of the shortlists' union, floor, quotas, per-cluster selection and the flash pass; (3) the growth.
# - "cluster" (CUDA, sm_90): (1) the growth; (2) per (batch row, KV head), a thread-block cluster that scores the codes
#   once for the group's heads and keeps the scores in its blocks' shared memory through the cut, the listing, the
#   plan, the per-cluster selection and the flash pass: no score leaves the chip, no code is read twice. Its hardest
#   part, the scores and each head's cut on chip, is measured in benchmarks/studies/cluster_shortlist.py.
DESIGNS = {"one_program": 3, "cluster": 2}  # the design's launches a layer


def projections(pipe_for, measured: list[dict], design: str) -> list[dict]:
    """Per configuration at each density, per head: the bytes of one of issue 56's designs (``DESIGNS``, not built)
    with the group overlaps measured on each offline model; for "one_program" also its candidate shares (a
    histogram's threshold) and code re-reads measured there."""
    G = SHAPE["query_heads"] // SHAPE["kv_heads"]
    rows = []
    for batch, context in CONFIGS:
        for density in DENSITIES:
            pipe = pipe_for(density, "per_head")
            for m in measured:
                found = m["densities"].get(str(density))
                if not found or "candidates_bucketed" not in found:
                    continue
                short, sel = (
                    transfer(found[key], m["heads_per_group"], G) for key in ("shortlist_union", "selected_union")
                )
                # the cluster design writes no candidates and reads every code once
                candidates, reread = (
                    (found["candidates_bucketed"], found["reread_codes"]) if design == "one_program" else (0.0, 0.0)
                )
                chosen = {"candidates": candidates, "reread": reread, "cluster_ids": design == "cluster"}
                if "member_lists" in found:  # the one-program design keeps the built selection and its lists' reads
                    chosen["selection_reads"] = (found["member_lists"], 1.0)
                parts = step_bytes(pipe, batch, context, *KV_SHAPE, short, sel, **chosen)
                rows.append(
                    {
                        "batch": batch,
                        "context": context,
                        "density": density,
                        "gqa": "per_head",
                        "overlap": f"measured on {m['model']}",
                        "candidates": candidates,
                        "reread_codes": reread,
                        **byte_fields(parts),
                        "launches": DESIGNS[design],
                    }
                )
    return rows


def share_line(r: dict) -> str:
    """One configuration's record as a printed row: each part's share of dense's bytes, then the total's."""
    share = {k: v / r["dense_bytes"] for k, v in r["bytes"].items()}
    return (
        f"{r['batch']:>6} × {r['context']:>7} {r['density']:>7.0%} {r['gqa']:>9} {r['overlap']:>34} "
        + " ".join(f"{share[k]:>6.1%}" for k in PARTS)
        + f" {r['share_of_dense']:>6.1%}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-measure", action="store_true", help="the bounds only: load no model")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    base = oa.load_spec(SPEC).model_dump(mode="json")

    def pipe_for(density: float, gqa: str) -> oa.Pipeline:
        return oa.build({**base, "budget": {"density": density}, "gqa": gqa})

    measured = [] if args.no_measure else [measure(model, DENSITIES) for model in MEASURE["tokens"]]
    rows = configs(pipe_for, measured)
    cuda_rows = configs(pipe_for, measured, cuda=True)
    designed = {design: projections(pipe_for, measured, design) for design in DESIGNS}
    result = {
        "shape": SHAPE,
        "spec": "specs/openattention.yaml",
        "kv_bytes": KV_BYTES,
        "measured_overlap": measured,
        "measure_setting": MEASURE,
        "configs": rows,
        "cuda_shortlist_configs": cuda_rows,
        "cuda_shortlist_note": "the fused step with the CUDA shortlist (sm_90+, nvcc; oa_plugins.kernels."
        f"pq_shortlist_cuda), built: the scores written once and read once by the selection ({CUDA_SCORE_PASSES} "
        "passes), the shortlist's K rows read per selection row by exact_logits (per head: G times)",
        "one_program_projection": designed["one_program"],
        "cluster_projection": designed["cluster"],
        "projection_note": "issue 56's one-program step, not built: the scores' trips replaced by each head's "
        f"candidates above a running threshold ({CHUNKS} chunks a row, a histogram of order keys floored to "
        f"2^{BUCKET_BITS}), written and read once; {DESIGNS['one_program']} launches as designed, not counted",
        "cluster_note": "issue 56's step as one CUDA thread-block cluster per (batch row, KV head), not built: the "
        "scores kept in the blocks' shared memory from the codes' one read to the flash pass (no score written, no "
        f"code read twice); {DESIGNS['cluster']} launches (the growth, the cluster) as designed, not counted; its "
        "scores and cut on chip timed in benchmarks/studies/cluster_shortlist.py, where the per-cluster selection on "
        "chip was slower than Triton's from memory (with that selection the scores are written and read once more)",
        "launches_note": "the fused step's launches (FusedStep.launch_names) at one size class of clusters; one more "
        "per further size class (the largest cluster's)",
        "codes_note": "codes counted packed, two 4-bit codes a byte, as the PQS index keeps them "
        "(Selector.scoring_bytes)",
        "provenance": provenance("cpu"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{'batch × context':>16} {'density':>7} {'gqa':>9} {'overlap':>34} {'codes':>6} {'short':>6} {'rows':>6} "
        f"{'proxy':>6} {'state':>6} {'scores':>6} {'total':>6}  (share of dense)"
    )
    for r in rows:
        print(share_line(r))
    print("the fused step with the CUDA shortlist (sm_90+):")
    for r in cuda_rows:
        print(share_line(r) + f"  {r['launches']} launches")
    for design, rows_of in designed.items():
        print(f"issue 56's {design.replace('_', '-')} design (not built; {DESIGNS[design]} launches):")
        for r in rows_of:
            print(share_line(r))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
