"""The decode step's cost model (benchmarks/step_cost.py): its bytes follow the spec and the shape, and its union
factors measure how far a GQA group's heads read the same rows."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import oa_core as oa
from conftest import load_benchmark

step_cost = load_benchmark("step_cost")
measures = load_benchmark("step_cost_measure")


def _pipe(density: float = 0.01, **spec) -> oa.Pipeline:
    return oa.build({"budget": {"density": density}, "sink": 4, "local": 64, **spec})


def test_the_parts_follow_the_spec_and_the_shape():
    pipe, D, N = _pipe(), 128, 16384
    parts = step_cost.step_bytes(pipe, batch=2, context=N, kv_heads=8, head_dim=D)
    heads, fixed = 2 * 8, 4 + 64
    selectable = math.floor(0.01 * N) - fixed
    assert parts["codes"] == heads * (N - fixed) * D / 4  # PQS: two 4-bit codes a byte, one per pair of dimensions
    assert parts["shortlist_keys"] == heads * math.ceil(4.0 * selectable) * D * 2  # rerank 4 × E_sel K rows, bf16
    assert parts["selected_rows"] == heads * (fixed + selectable) * 2 * D * 2
    assert parts["proxies"] == heads * 64 * (3 * D + 1) * 4  # Σk, Σv, Σk⊙k and the count of 64 clusters, float32
    assert parts["dense"] == heads * N * 2 * D * 2
    shared = step_cost.step_bytes(_pipe(gqa="shared"), batch=2, context=N, kv_heads=8, head_dim=D, group=4)
    shortlist = math.ceil(4.0 * selectable)  # each listed position's box written once
    assert shared["scores"] == heads * ((N - fixed) * step_cost.SCORE_PASSES + shortlist) * 4  # a row per KV head
    assert parts["scores"] == 4 * shared["scores"]  # per head (the default): a row per query head of the group
    # each selection row reads its clusters' int32 member lists (an upper bound: every list) and its shortlist's
    # int64 cluster numbers
    assert shared["members"] == heads * (N - fixed) * 4 and parts["members"] == 4 * shared["members"]
    assert parts["state"] - shared["state"] == heads * 3 * shortlist * 8
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k not in ("total", "dense")))
    mean = step_cost.step_bytes(_pipe(proxy="mean"), 2, N, 8, D)
    assert mean["proxies"] == heads * 64 * (2 * D + 1) * 4


def test_disjoint_heads_read_their_shortlists_and_selections_once_each():
    pipe = _pipe()
    agree = step_cost.step_bytes(pipe, 1, 32768, 8, 128, 1.0, 1.0)
    disjoint = step_cost.step_bytes(pipe, 1, 32768, 8, 128, 4.0, 4.0)
    assert disjoint["shortlist_keys"] == 4 * agree["shortlist_keys"]
    fixed_rows = 8 * (4 + 64) * 2 * 128 * 2
    assert disjoint["selected_rows"] - fixed_rows == 4 * (agree["selected_rows"] - fixed_rows)  # the window once
    assert disjoint["codes"] == agree["codes"] and disjoint["proxies"] == agree["proxies"]
    assert step_cost.step_bytes(_pipe(0.03), 1, 32768, 8, 128)["total"] > agree["total"]


def test_the_built_flash_pass_reads_each_selection_rows_own_rows_and_proxies():
    """``per_row``: a program per selection row reads its selected rows, the sink and the window, so per head those
    are G times the group's shared read whatever the heads share; shared, once. Of the proxies the prologue reads Σk
    and Σk⊙k once for the group and writes each head's z̄_b, σ̂_b²; each selection row reads Σv, the count and its
    heads' statistics."""
    per_head, shared = _pipe(), _pipe(gqa="shared")
    D, C, heads = 128, 64, 8
    for union in (1.0, 2.5, 4.0):
        built = step_cost.step_bytes(per_head, 1, 32768, heads, D, 1.0, union, per_row=True)
        once = step_cost.step_bytes(shared, 1, 32768, heads, D, 1.0, 1.0, group=4)
        assert built["selected_rows"] == 4 * once["selected_rows"]
        assert built["proxies"] == heads * C * 4 * ((2 * D + 1 + 2 * 4) + 4 * (D + 1) + 2 * 4)
        shared_built = step_cost.step_bytes(shared, 1, 32768, heads, D, per_row=True, group=4)
        assert shared_built["proxies"] == heads * C * 4 * ((2 * D + 1 + 2 * 4) + (D + 1) + 2 * 4)
        assert {k: v for k, v in shared_built.items() if k not in ("proxies", "total")} == {
            k: v for k, v in once.items() if k not in ("proxies", "total")
        }
    configs = step_cost.configs(lambda density, gqa: _pipe(density, gqa=gqa), [])
    for r in configs:
        assert r["selected_union"] == (4 if r["gqa"] == "per_head" else 1)


def _state(pipe, heads_alike: bool):
    gen = torch.Generator().manual_seed(0)
    B, Hkv, G, N, D = 1, 2, 4, 600, 32
    keys, values = torch.randn(B, Hkv, N, D, generator=gen), torch.randn(B, Hkv, N, D, generator=gen)
    prefill = torch.randn(B, Hkv * G, 64, D, generator=gen)
    state = pipe.prepare(keys, values, prefill)
    queries = torch.randn(B, Hkv, 1, 3, D, generator=gen)
    queries = queries.expand(B, Hkv, G, 3, D) if heads_alike else torch.randn(B, Hkv, G, 3, D, generator=gen)
    return state, queries.reshape(B, Hkv * G, 3, D).contiguous()


def test_a_group_of_identical_heads_has_union_factor_one_and_distinct_heads_more():
    pipe = oa.build({"budget": {"density": 0.1}, "sink": 4, "local": 16, "gqa": "per_head"})
    state, same = _state(pipe, heads_alike=True)
    assert measures.union_factors(measures.decisions(pipe, state, same)) == pytest.approx((1.0, 1.0))
    state, different = _state(pipe, heads_alike=False)
    shortlist, selected = measures.union_factors(measures.decisions(pipe, state, different))
    assert 1.2 < shortlist <= 4.0 and 1.2 < selected <= 4.0


def test_a_measured_union_keeps_its_share_of_the_way_to_disjoint_on_another_group():
    assert step_cost.transfer(2.0, 3, 4) == pytest.approx(2.5)  # halfway from 1 to 3 → halfway from 1 to 4
    assert step_cost.transfer(1.0, 3, 4) == 1.0 and step_cost.transfer(3.0, 3, 4) == 4.0
    assert step_cost.transfer(2.4, 4, 4) == 2.4


def test_the_launches_are_the_fused_step_s_own_count():
    """The cost model's launches are the fused step's declaration (``FusedStep.launch_names``, which
    ``tests/test_flash_step.py`` checks against a step's launches): the default's seven at one size class, QGS's
    twelve with its re-rank, the paper's pipeline five."""
    assert step_cost.fused_launches(_pipe()) == 7
    specs = Path(__file__).resolve().parents[1] / "specs"
    assert step_cost.fused_launches(oa.build(specs / "ablate-selector-qgs.yaml")) == 12
    assert step_cost.fused_launches(oa.build(specs / "openattention-paper.yaml")) == 5


def test_the_cuda_shortlist_step_counts_two_score_passes_and_each_rows_k_rows():
    """With the CUDA shortlist the default's step is six launches; its scores go through memory twice, not five
    times, and per head each selection row's listed K rows are read for it alone (the union factor is G)."""
    assert step_cost.fused_launches(_pipe(), cuda=True) == 6

    def pipe_for(density, gqa):
        return _pipe(density, gqa=gqa)

    triton, cuda = step_cost.configs(pipe_for, []), step_cost.configs(pipe_for, [], cuda=True)
    assert len(triton) == len(cuda)
    for a, b in zip(triton, cuda, strict=True):
        assert b["launches"] == 6 and a["launches"] == 7
        rows = 4 if a["gqa"] == "per_head" else 1
        fewer = (step_cost.SCORE_PASSES - 2) * rows * 4 * a["batch"] * 8  # written once, read once by the selection
        assert a["bytes"]["scores"] - b["bytes"]["scores"] == pytest.approx(fewer * (a["context"] - 68), rel=1e-6)
        union = 4 if a["gqa"] == "per_head" else 1
        assert b["shortlist_union"] == union
        assert b["bytes"]["shortlist_keys"] == pytest.approx(
            a["bytes"]["shortlist_keys"] * union / a["shortlist_union"]
        )


def test_running_candidates_hold_the_shortlist_and_follow_the_order_of_the_scores():
    C, length = measures.CHUNKS, 5
    N = C * 8
    best_first = torch.arange(N, 0, -1).float()[None]
    assert int(measures.running_candidates(best_first, length).sum()) == length  # later chunks fall below the cut
    best_last = torch.arange(N).float()[None]
    assert int(measures.running_candidates(best_last, length).sum()) == C * length  # each chunk beats the cut
    scores = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    scores[:, :7] = -math.inf  # not selectable: never written
    written = measures.running_candidates(scores, 40)
    bucketed = measures.running_candidates(scores, 40, bucket_bits=20)
    top = scores.topk(40, dim=-1).indices
    assert bool(written.gather(-1, top).all()) and bool((bucketed | ~written).all())  # shortlist ⊆ exact ⊆ bucketed
    assert not bool(bucketed[:, :7].any()) and 40 < int(written.sum(-1).min()) < 1000


def test_a_shortlist_of_every_position_leaves_nothing_outside_it():
    spec = {"budget": {"density": 0.1}, "sink": 4, "local": 16, "gqa": "per_head"}
    whole = oa.build({**spec, "selector": {"name": "pq", "rerank": 100}})
    found = measures.one_program_factors(measures.decisions(whole, *_state(whole, heads_alike=False)))
    assert found["candidates"] == 1.0 and found["outside_shortlist"] == 0.0 and found["reread_codes"] == 0.0
    narrow = oa.build({**spec, "budget": {"density": 0.05}})
    found = measures.one_program_factors(measures.decisions(narrow, *_state(narrow, heads_alike=False)))
    assert 0 < found["candidates"] <= found["candidates_bucketed"] < 1


def test_the_selection_reads_the_lists_of_clusters_with_a_quota_and_the_sectors_of_partial_ones():
    spec = {"sink": 4, "local": 16, "gqa": "per_head"}
    narrow = oa.build({**spec, "budget": {"density": 0.05}})
    decided = measures.decisions(narrow, *_state(narrow, heads_alike=False))
    found = measures.selection_factors(decided)
    quotas, allocation = decided.explanation.quotas, decided.explanation.allocation
    C = quotas.shape[-1]
    # one selection row by hand: (batch row 0, KV head 1, head 2, query 0)
    row, cluster = quotas[0, 1, 2, 0], allocation.assignment[0, 1]
    counts = allocation.counts[0, 1]
    inside = cluster < C
    quota_at = row[cluster.clamp_max(C - 1)]
    partial = inside & (quota_at > 0) & (quota_at < counts[cluster.clamp_max(C - 1)])
    one = measures.selection_factors(decided._replace(explanation=_one_row(decided.explanation, (0, 1, 2, 0))))
    assert one["member_lists"] == pytest.approx(float((inside & (quota_at > 0)).sum() / inside.sum()))
    sectors = {int(p) // 8 for p in partial.nonzero().flatten()}
    assert one["score_sectors"] == pytest.approx(len(sectors) / math.ceil(cluster.shape[-1] / 8))
    assert 0 < found["score_sectors"] < 1 and 0 < found["member_lists"] < 1
    wide = oa.build({**spec, "budget": {"density": 0.3}})  # more clusters with a quota: more lists read
    assert (
        measures.selection_factors(measures.decisions(wide, *_state(wide, heads_alike=False)))["member_lists"]
        > (found["member_lists"])
    )


def _one_row(explanation, at):
    """The explanation cut to one selection row ``at`` (batch row, KV head, head, query)."""
    b, h, g, t = at
    allocation = dataclasses.replace(
        explanation.allocation,
        assignment=explanation.allocation.assignment[b : b + 1, h : h + 1],
        counts=explanation.allocation.counts[b : b + 1, h : h + 1],
    )
    quotas = explanation.quotas[b : b + 1, h : h + 1, g : g + 1, t : t + 1]
    return dataclasses.replace(explanation, quotas=quotas, allocation=allocation)


def test_the_designs_differ_in_the_scores_the_codes_and_the_member_lists_only():
    """Both projected designs take the measured overlaps; the one-program design writes and reads each head's
    candidates and re-reads a share of the codes, the cluster design keeps every score on chip, reads each code
    once and each position's cluster id once for the group: nothing else differs."""
    found = {"shortlist_union": 2.0, "selected_union": 2.5, "candidates_bucketed": 0.2, "reread_codes": 0.1}
    measured = [{"model": "m", "heads_per_group": 4, "densities": {str(d): found for d in step_cost.DENSITIES}}]

    def pipe_for(density, gqa):
        return _pipe(density, gqa=gqa)

    one, cluster = (step_cost.projections(pipe_for, measured, design) for design in ("one_program", "cluster"))
    assert len(one) == len(cluster) == len(step_cost.CONFIGS) * len(step_cost.DENSITIES)
    for a, b in zip(one, cluster, strict=True):
        assert b["bytes"]["scores"] == 0 < a["bytes"]["scores"]
        assert a["bytes"]["codes"] == pytest.approx(1.1 * b["bytes"]["codes"], abs=1)
        assert b["bytes"]["members"] * 4 * 4 == a["bytes"]["members"]  # one-byte ids once, not int32 lists per head
        same = {k: v for k, v in a["bytes"].items() if k not in ("scores", "codes", "members")}
        assert same == {k: v for k, v in b["bytes"].items() if k not in ("scores", "codes", "members")}
        assert (a["launches"], b["launches"]) == (3, 2) and a["share_of_dense"] > b["share_of_dense"]
