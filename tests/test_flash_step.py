"""flash's fused static step (oa_plugins.kernels.flash_step) under Triton's interpreter, for both selectors it fuses
(QGS and PQS, the default): at every step the rows it reads are the reference pipeline's and its output is the
reference's; the state it leaves (codes, clusters, pooled sums, member lists) is the composed step's. With GQA shared
and per head (3:1, 4:1 and 1:1), a left-padded row, growth across the local window's edge, both tails, bfloat16, and a
cache filled to its capacity."""

import pytest
import torch

import oa_core as oa
from conftest import make_inputs, relative_error
from oa_core.static import StaticState
from oa_core.testing.fused import decode_side_by_side, reference_rows
from oa_plugins.allocators import errorgate
from oa_plugins.kernels.flash_step import PQSScoring, QGSScoring

# The paper's pipeline (no re-rank, no floor): the fused step's seven launches; the two-stage tests below add the
# default's re-rank and floor (its eight more launches) to it.
SPEC = {
    "clusterer": {"name": "qgc", "num_clusters": 8},
    "selector": {"name": "qgs", "rerank": 0},
    "allocator": {"name": "errorgate", "floor": 0},
    "sink": 4,
    "local": 16,
    "budget": {"density": 0.2},
    "kernel": "flash",
}


@pytest.fixture(autouse=True)
def triton_allocation():
    """The reference pipeline allocates with ErrorGate's Triton kernel too (on the CPU it would run the torch ops,
    whose float rounding may move a quota at a tie): row for row the same arithmetic."""
    if "flash" not in oa.available()["kernel"]:
        pytest.skip("no flash kernel (Triton)")
    previous, errorgate.INTERPRET_ON_CPU = errorgate.INTERPRET_ON_CPU, True
    yield
    errorgate.INTERPRET_ON_CPU = previous


PQS = {"name": "pq", "rerank": 0}  # the default's selector, without its re-rank (as SPEC's QGS)


def run_fused(spec, static=True, **inputs):
    """``decode_side_by_side`` (the reference pipeline, the composed and the fused static steps on the same inputs)
    → per step (reference rows, fused rows, reference output, fused output), and the two static states at the end;
    at every step the fused index — sink, window, each cluster's run, padding — and its runs are the composed
    step's, column for column. ``static=False``: the reference pipeline alone → its rows per step."""
    if not static:
        return reference_rows(spec, **{k: v for k, v in inputs.items() if k != "room"})
    records, composed, fused = decode_side_by_side(spec, **inputs)
    for record in records:
        assert record.same_layout and not record.weighted
    return [(r.reference_rows, r.rows, r.reference_out, r.out) for r in records], composed, fused


def assert_same_state(composed, fused):
    assert torch.equal(fused.assignment, composed.assignment)
    assert torch.equal(fused.member_counts, composed.member_counts)
    assert torch.equal(fused.members, composed.members)
    for name in ("count", "key_sum", "value_sum", "key_square_sum"):
        assert torch.allclose(getattr(fused.pooled, name), getattr(composed.pooled, name), rtol=1e-6, atol=1e-5), name
    assert fused.token_fields == composed.token_fields and "codes" in fused.token_fields
    for name in fused.token_fields:  # the selector's per-token codes (QGS: codes and scales; PQS: codes)
        ours, theirs = getattr(fused.index, name), getattr(composed.index, name)
        if ours.is_floating_point():
            assert torch.allclose(ours, theirs, rtol=1e-6, atol=0), name
        else:
            assert torch.equal(ours, theirs), name


@pytest.mark.parametrize(
    "selector,gqa,tail,room,group",
    [
        (SPEC["selector"], "shared", "proxy", 0, 3),
        (SPEC["selector"], "per_head", "discard", 0, 3),
        (PQS, "per_head", "proxy", 9, 4),
        (PQS, "shared", "proxy", 0, 4),
        (PQS, "per_head", "discard", 0, 1),
    ],
    ids=["qgs-shared", "qgs-per_head-discard", "pq-per_head-4:1", "pq-shared-4:1", "pq-1:1-discard"],
)
def test_each_fused_step_reads_the_reference_rows_and_gives_its_output(selector, gqa, tail, room, group):
    spec = {**SPEC, "selector": selector, "gqa": gqa, "tail": tail}
    steps, composed, fused = run_fused(spec, room=room, group=group)
    assert isinstance(fused.fused.scoring, PQSScoring if selector is PQS else QGSScoring)
    for ref_rows, rows, ref_out, out in steps:
        assert rows == ref_rows
        assert relative_error(out, ref_out) < 1e-4
    assert_same_state(composed, fused)


def test_no_local_window_the_new_row_joins_in_its_own_step():
    """``local: 0``: the row a step appends leaves the (empty) window at once: it joins a cluster, and the selection
    scores it, from the codes written in that same step."""
    steps, composed, fused = run_fused({**SPEC, "local": 0, "budget": {"density": 0.3}})
    newest = fused.assignment[:, :, 140:148]
    assert bool((newest < fused.num_clusters).all())  # each appended row joined a cluster in its own step
    for ref_rows, rows, ref_out, out in steps:
        assert rows == ref_rows
        assert relative_error(out, ref_out) < 1e-4
    assert_same_state(composed, fused)


def test_clusters_over_several_chunks_join_and_count_where_they_are():
    """40 clusters: the step's programs take 16 each (the last 8), and a leaving row joins a cluster of whichever
    chunk holds it — its count, sums and the chunk's statistics there, and nowhere else."""
    tokens, steps, local = 300, 5, SPEC["local"]
    spec = {**SPEC, "clusterer": {"name": "qgc", "num_clusters": 40}, "budget": {"density": 0.1}}
    steps_seen, composed, fused = run_fused(spec, tokens=tokens, steps=steps)
    joined = fused.assignment[:, :, tokens - local : tokens - local + steps]
    assert bool((joined >= 16).any()) and bool((joined < 16).any())  # joins in the first chunk and in later ones
    for ref_rows, rows, ref_out, out in steps_seen:
        assert rows == ref_rows
        assert relative_error(out, ref_out) < 1e-4
    assert_same_state(composed, fused)


TWO_STAGE = {"selector": {"name": "qgs", "rerank": 4}, "allocator": {"name": "errorgate", "floor": 0.5}}
PQS_TWO_STAGE = {"selector": {"name": "pq", "rerank": 4}, "allocator": {"name": "errorgate", "floor": 0.5}}  # default


@pytest.mark.parametrize(
    "gqa,stages,block",
    [
        ("per_head", PQS_TWO_STAGE, 64),  # PQS's listing and refine by 32 positions, the QGS passes' by 64
        ("shared", TWO_STAGE, 1024),
        ("shared", {"selector": {"name": "pq", "rerank": 2}}, 1024),
        # most clusters read whole: the floor's reads bind the rest's caps
        ("shared", {**TWO_STAGE, "budget": {"density": 0.7}}, 16),
    ],
)
def test_the_two_stage_selection_and_the_floor_read_the_reference_rows(gqa, stages, block, monkeypatch):
    """The rerank and ErrorGate's floor in the fused step (``two_stage``'s launches): the composed step's
    index column for column, the reference's rows and output, over repeated keys (ties in the codes and in the exact
    logits, taken by position) — and with blocks of 16 positions and 4 shortlist entries, every pass crosses
    blocks. The rows are not the paper pipeline's: the re-ranking is not a no-op."""
    from oa_plugins.kernels import two_stage

    monkeypatch.setattr(two_stage, "SEGMENT", block)
    monkeypatch.setattr(two_stage, "PQ_SEGMENT", block // 2)
    monkeypatch.setattr(two_stage, "RADIX_BLOCK", block)
    monkeypatch.setattr(two_stage, "LIST_BLOCK", 4 if block == 16 else two_stage.LIST_BLOCK)
    monkeypatch.setattr(two_stage, "PQ_LIST_BLOCK", 4 if block == 16 else two_stage.PQ_LIST_BLOCK)
    spec = {**SPEC, "gqa": gqa, **stages}
    steps, composed, fused = run_fused(spec, steps=5, room=3, repeat=slice(40, 70))
    assert fused.fused.two_stage is not None
    for ref_rows, rows, ref_out, out in steps:
        assert rows == ref_rows
        assert relative_error(out, ref_out) < 1e-4
    assert_same_state(composed, fused)
    no_rerank = {**spec["selector"], "rerank": 0}
    plain = run_fused(
        {**SPEC, "gqa": gqa, "budget": spec["budget"], "selector": no_rerank},
        steps=5,
        repeat=slice(40, 70),
        static=False,
    )  # the reference's rows without the re-rank (the fused step's own, as the tests above show)
    assert any(rows != plain_rows for (_, rows, _, _), plain_rows in zip(steps, plain, strict=True))


@pytest.mark.parametrize("gqa,group", [("per_head", 4), ("shared", 4), ("per_head", 1)])
def test_pqs_three_launch_shortlist_leaves_what_the_scores_and_seven_launches_leave(gqa, group, monkeypatch):
    """``pq_shortlist`` (PQS's scores with the first digit's histogram, the cut, the listing) leaves what PQS's score
    kernel and the shortlist's seven launches leave: the masked scores, each row's length, cut and ties at it, its
    positions and exact logits in position order, each segment's place — over repeated keys (ties), a left-padded
    row, segments of 16 positions and score chunks of 32 (a chunk's histogram added to the row's), the listed rows
    of a block of 8 positions gathered two at a time."""
    from oa_plugins.kernels import two_stage

    monkeypatch.setattr(two_stage, "SEGMENT", 32)
    monkeypatch.setattr(two_stage, "PQ_SEGMENT", 16)
    monkeypatch.setattr(two_stage, "SCORE_CHUNK", 32)
    monkeypatch.setattr(two_stage, "RADIX_BLOCK", 16)
    monkeypatch.setattr(two_stage, "LIST_BLOCK", 4)
    monkeypatch.setattr(two_stage, "PQ_LIST_BLOCK", 8)
    monkeypatch.setattr(two_stage, "LIST_GATHER", 2)  # a block's listed rows gathered two at a time
    keys, values, prefill, _ = make_inputs(tokens=141, group=group)
    keys[:, :, 70:100] = keys[:, :, 40:70]
    mask = torch.ones(2, 140, dtype=torch.bool)
    mask[1, :25] = False
    pipe = oa.build({**SPEC, "gqa": gqa, **PQS_TWO_STAGE})
    state = StaticState.from_state(pipe.prepare(keys[:, :, :140], values[:, :, :140], prefill, mask=mask), 150)
    fused = state.fused
    B, H, _, D = keys.shape
    cache_k = keys.new_zeros(B, H, 150, D)
    cache_k[:, :, :141] = keys
    state.length += 1
    query = keys[:, torch.arange(H * group) // group, 140:141] * 1.1
    Gs, G = (1, group) if gqa == "shared" else (group, 1)
    budget_args = (state.length, state.start, fused.density, fused.fixed, fused.tokens)
    tables = fused.prologue(state, query, cache_k, torch.zeros_like(cache_k))[0]  # (the state grows: one step's)
    seven = torch.empty(B * H * Gs, 150)
    fused.scoring.score(state, tables, seven, G)
    expected = fused.two_stage.shortlist(seven, cache_k, query, state, budget_args, Gs, G, pipe.spec.local)
    one = torch.full_like(seven, float("nan"))
    got = fused.two_stage.pq_shortlist(tables, state, one, cache_k, query, budget_args, Gs, G)
    # The same bits: the masked scores, and the listed positions boxed (their entry in the shortlist) by both.
    assert torch.equal(one[:, :141].view(torch.int32), seven[:, :141].view(torch.int32))
    (listed, exact, counts, cut, ties, _, places), (listed2, exact2, counts2, cut2, ties2, _, places2) = got, expected
    for row, count in enumerate(counts.tolist()):
        boxed = one[row, :141].isnan().nonzero().flatten()
        assert torch.equal(boxed, listed[row, :count].long().sort().values)
        entries = (one[row, boxed].view(torch.int32) & 0x7FFFFF) - 1
        assert torch.equal(listed[row, entries].long(), boxed)  # each box names its own entry
    assert torch.equal(counts, counts2) and torch.equal(cut, cut2) and torch.equal(ties, ties2)
    assert int(counts.min()) > 0 and int(ties.max()) > 0  # rows listed, ties at the cut taken in part
    segments = -(-141 // 32)  # the seven launches' segments of 32 positions, PQS's of 16: every other one's place
    assert torch.equal(places[:, : 2 * segments : 2], places2[:, :segments])
    for row, count in enumerate(counts.tolist()):
        assert torch.equal(listed[row, :count], listed2[row, :count])
        assert torch.equal(exact[row, :count], exact2[row, :count])


def test_pqs_cut_of_scores_that_share_their_first_digits_is_the_stable_sorts():
    """``pq_cut`` against a stable sort of made scores: most of a row share their keys' first two bytes and differ in
    the third and last (the third pass keeps them, the last digit and the places come from the kept alone), ties
    at the cut taken in part, -inf left out, blocks of 32 positions over segments of 16."""
    from oa_core.ops.selection import order_keys
    from oa_plugins.kernels.pq_shortlist_programs import pq_cut

    gen = torch.Generator().manual_seed(7)
    rows, cap, n, k, segment = 3, 200, 190, 40, 16
    third = torch.randint(0, 512, (rows, cap), generator=gen).float() * 2**-16
    last = torch.randint(0, 128, (rows, cap), generator=gen).float() * 2**-23
    scores = 1.0 + third + last
    scores[:, 60:80] = scores[:, 100:120]  # ties
    scores[0, :30] = float("-inf")
    scores[1, ::7] = 4.0  # a few keys above, by their first digit
    scores[:, n:] = float("nan")  # past the length: never read
    for r in range(rows):  # the k-th best repeated after it: ties at the cut taken in part
        kth = torch.argsort(-scores[r, :n].nan_to_num(-1.0), stable=True)[k - 1]
        scores[r, n - 3 : n] = scores[r, kth] if kth < n - 3 else scores[r, n - 3 : n]
    keys = order_keys(scores[:, :n]) + 2**31
    valid = scores[:, :n] > float("-inf")
    hist = torch.stack([torch.bincount((keys[r][valid[r]] >> 24), minlength=256) for r in range(rows)]).int()
    S = -(-cap // segment)
    counts, ties = torch.zeros(rows, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32)
    cut, places = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, S, 2, dtype=torch.int32)
    length, start = torch.tensor([n]), torch.tensor([0])
    one = torch.tensor(1.0, dtype=torch.float64)
    near = torch.empty(rows, cap, dtype=torch.int32)
    pq_cut[(rows,)](
        scores, hist, length, start, one, one, counts, cut, ties, places, near, rows, 1, cap, 0, k, 1000, S,
        SEGMENT=segment, BLOCK=32, BLOCK_S=16,
    )  # fmt: skip
    partly = []  # ties at the cut the shortlist takes only in part
    for r in range(rows):
        order = torch.argsort(-keys[r].masked_fill(~valid[r], -1), stable=True)[:k]
        tau = int(keys[r, order[-1]])
        assert int(counts[r]) == k and int(cut[r]) == tau
        taken = int((keys[r, order] == tau).sum())
        assert int(ties[r]) == taken and taken > 0
        partly.append(taken < int(((keys[r] == tau) & valid[r]).sum()))
        for s_ in range(S):
            before = slice(0, min(s_ * segment, n))
            above = int(((keys[r, before] > tau) & valid[r, before]).sum())
            tied = int(((keys[r, before] == tau) & valid[r, before]).sum())
            assert places[r, s_].tolist() == [above + min(tied, taken), tied]
    assert any(partly)
    one_key = int(order_keys(torch.tensor([1.0]))[0]) + 2**31
    assert ((keys >> 16) == one_key >> 16).float().mean() > 0.5  # most share 1.0's first two digits


@pytest.mark.parametrize(
    "stages",
    [{}, {"selector": PQS}, TWO_STAGE, PQS_TWO_STAGE, {"selector": {"name": "pq", "rerank": 2}}],
    ids=["qgs", "pq", "qgs-two-stage", "default", "pq-rerank-no-floor"],
)
def test_a_step_launches_what_it_declares(stages, monkeypatch):
    """``FusedStep.launches`` — what the cost model counts — is what a step launches, program for program (counted
    at the interpreter's launch); the default's step (Triton's shortlist) is seven launches with one size class of
    clusters: the growth runs in the projection's launch, and the flash pass merges each row's parts in its last
    program."""
    from collections import Counter

    from triton.runtime.interpreter import InterpretedFunction

    launched = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    keys, values, prefill, _ = make_inputs(tokens=140)
    pipe = oa.build({**SPEC, **stages})
    state = StaticState.from_state(pipe.prepare(keys[:, :, :120], values[:, :, :120], prefill), 130)
    cache_k, cache_v = keys[:, :, :130].clone(), values[:, :, :130].clone()
    state.length += 1
    declared = state.fused.launches(state)
    monkeypatch.setattr(InterpretedFunction, "run", counted)
    state.fused.run(state, keys[:, :, 120:121].repeat_interleave(3, 1), cache_k, cache_v)
    assert Counter(launched) == Counter(declared)
    if stages is PQS_TWO_STAGE:
        assert len(declared) == 6 + declared.count("_select_kernel") and declared.count("_select_kernel") >= 1
        assert "merge" not in declared and "grow" not in declared


def test_a_floor_above_the_shortlist_composes_its_own_step():
    from oa_plugins.kernels.flash_step import fused_unsupported

    keys, values, prefill, _ = make_inputs(tokens=120)
    for selector in [{"name": "qgs", "rerank": 0}, {"name": "qgs", "rerank": 0.25}]:
        pipe = oa.build({**SPEC, "selector": selector, "allocator": {"name": "errorgate", "floor": 0.5}})
        state = StaticState.from_state(pipe.prepare(keys, values, prefill), 130)
        assert state.fused is None
        assert "errorgate floor: 0.5 above qgs rerank" in fused_unsupported(state)


def test_a_shortlist_longer_than_a_box_can_name_composes_its_own_step(monkeypatch):
    """The selection reads a listed score's exact logit through its box, a NaN whose 23-bit payload names the entry:
    a shortlist that could pass that (here the bound lowered to 10 entries) declines the fused step, which says why."""
    from oa_plugins.kernels import flash_step

    keys, values, prefill, _ = make_inputs(tokens=120)
    pipe = oa.build({**SPEC, **PQS_TWO_STAGE})
    assert StaticState.from_state(pipe.prepare(keys, values, prefill), 130).fused is not None
    monkeypatch.setattr(flash_step, "MAX_BOXED", 10)
    state = StaticState.from_state(pipe.prepare(keys, values, prefill), 130)
    assert state.fused is None
    assert "fused: at most 10, the selection's boxes" in flash_step.fused_unsupported(state)


@pytest.mark.parametrize("selector", [SPEC["selector"], PQS], ids=["qgs", "pq"])
def test_bfloat16_and_a_cache_filled_to_its_capacity(selector):
    spec = {**SPEC, "selector": selector, "budget": {"tokens": 40}}
    steps, composed, fused = run_fused(spec, tokens=100, steps=8, dtype=torch.bfloat16)
    if selector is not PQS:  # the last step wrote the last slot's codes (PQS's: compared with the composed step's)
        assert bool((fused.index.scales[..., -1] > 0).all())
    for ref_rows, rows, ref_out, out in steps:
        assert rows == ref_rows
        assert out.dtype == torch.bfloat16 and relative_error(out, ref_out) < 1e-2
    assert_same_state(composed, fused)


def test_other_components_compose_their_own_steps():
    keys, values, prefill, _ = make_inputs(tokens=120)
    for spec, why in [
        ({**SPEC, "clusterer": {"name": "kmeans", "num_clusters": 8}}, "clusterer 'kmeans'"),
        ({**SPEC, "allocator": {"name": "mass"}}, "allocator 'mass'"),
        ({**SPEC, "kernel": "torch"}, None),
    ]:
        pipe = oa.build(spec)
        state = StaticState.from_state(pipe.prepare(keys, values, prefill), 130)
        assert state.fused is None
        if why:
            from oa_plugins.kernels.flash_step import fused_unsupported

            assert why in fused_unsupported(state)
    # A subclass of QGC may place new keys its own way: the fused step, which repeats QGC's arithmetic, declines it.
    from oa_plugins.clusterers.qgc import QueryGeometryClusterer

    pipe = oa.build(SPEC)
    pipe.clusterer.__class__ = type("FarthestQGC", (QueryGeometryClusterer,), {"name": "farthest"})
    assert StaticState.from_state(pipe.prepare(keys, values, prefill), 130).fused is None


def test_the_new_rows_codes_are_qgs_quantize_with_halves_to_even():
    """A key whose projection lands on exact halves of the code step: ``grow`` rounds them as ``torch.round`` (to
    even), as QGS's own ``quantize`` does; the rest of its codes too."""
    from oa_plugins.selectors.qgs import quantize

    keys, values, prefill, _ = make_inputs(tokens=140)
    pipe = oa.build(SPEC)
    state = StaticState.from_state(pipe.prepare(keys[:, :, :120], values[:, :, :120], prefill), 130)
    r = state.fused.scoring.basis.shape[-1]
    state.fused.scoring.basis.zero_()
    state.fused.scoring.basis[..., torch.arange(r), torch.arange(r)] = 1.0  # kᵀU_r: the key's first r coordinates
    cache_k, cache_v = keys[:, :, :130].clone(), values[:, :, :130].clone()
    halves = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5, 10.25, 7.0, -1.5, 4.5, 0.0, 9.5])
    cache_k[:, :, 120, :r] = halves[:r]
    state.length += 1
    state.fused.run(state, keys[:, :, 120:121].repeat_interleave(3, 1), cache_k, cache_v)
    codes, scales = quantize(cache_k[:, :, 120:121].float() @ state.fused.scoring.basis)
    assert torch.equal(state.index.codes[:, :, 120:121], codes)
    assert torch.equal(state.index.scales[:, :, 120:121], scales)
    assert codes[0, 0, 0, 1] == 2 and codes[0, 0, 0, 2] == 4  # the case tested: 2.5 → 2, 3.5 → 4


def test_the_new_rows_pqs_codes_are_the_first_nearest_centroid_across_tiles():
    """``pq_project`` codes the new row as PQS's ``encode`` does: each sub-space's nearest centroid, the first of
    equals — within a tile of 16 centroids and across tiles (8-bit codes: 256 centroids, 16 tiles)."""
    from oa_plugins.selectors.pq import encode

    keys, values, prefill, _ = make_inputs(tokens=140)
    pipe = oa.build({**SPEC, "selector": {"name": "pq", "bits": 8, "rerank": 0}})
    state = StaticState.from_state(pipe.prepare(keys[:, :, :120], values[:, :, :120], prefill), 130)
    centroids = state.fused.scoring.centroids  # [B, Hkv, M, 256, 2]
    assert centroids.shape[3] == 256
    cache_k, cache_v = keys[:, :, :130].clone(), values[:, :, :130].clone()
    # (Fewer training keys than centroids: the learnt ones repeat. Each tie below is a point of its own.)
    centroids[:, :, 0, [3, 40]] = torch.tensor([50.0, -50.0])  # sub-space 0: equal centroids in tiles 0 and 2
    centroids[:, :, 1, [5, 7]] = torch.tensor([-60.0, 60.0])  # sub-space 1: equal centroids in one tile
    cache_k[:, :, 120, 0:2] = torch.tensor([49.0, -49.0])
    cache_k[:, :, 120, 2:4] = torch.tensor([-59.0, 59.0])
    state.length += 1
    state.fused.run(state, keys[:, :, 120:121].repeat_interleave(3, 1), cache_k, cache_v)
    kept = state.index.codes[:, :, 120]  # 8-bit codes: a byte each
    assert bool((kept[..., 0] == 3).all()) and bool((kept[..., 1] == 5).all())
    assert torch.equal(kept, encode(cache_k[:, :, 120:121], centroids)[:, :, 0])


def test_the_prologues_pqs_tables_are_the_selectors_rounded_to_float16():
    """The fused step's tables are PQS's (``half_tables``): q_m·c_{m,j} rounded to float16 — what lets the CUDA
    shortlist keep two heads a 32-bit word — and ±65504 past its range (a head's query scaled 10^6), never ±inf."""
    from oa_plugins.selectors.pq import HALF_MAX

    keys, values, prefill, _ = make_inputs(tokens=140, group=2)
    pipe = oa.build({**SPEC, "selector": PQS})
    state = StaticState.from_state(pipe.prepare(keys[:, :, :120], values[:, :, :120], prefill), 130)
    B, H, _, D = keys.shape
    query = keys[:, torch.arange(2 * H) // 2, 120:121] * 1.1
    query[:, 1] *= 1e6
    state.length += 1
    tables = state.fused.prologue(state, query, keys[:, :, :130].clone(), values[:, :, :130].clone())[0]
    M, C, dims = state.index.centroids.shape[2:]
    entries = torch.einsum("bhgmd,bhmcd->bhgmc", query.view(B, H, 2, M, dims).double(), state.index.centroids.double())
    assert tables.shape == entries.shape and tables.isfinite().all()
    assert torch.equal(tables, tables.half().float())  # float16 values
    saturated = entries.abs() > HALF_MAX
    assert saturated[:, 0, 1].any() and bool((tables[saturated].abs() == HALF_MAX).all())
    inside = ~saturated
    assert (tables[inside].double() - entries[inside]).abs().le(2.0**-11 * entries[inside].abs() + 1e-7).all()
    assert (tables[inside].double() - entries[inside]).abs().max() > 1e-7  # (rounded, not float32's entries)


def test_the_new_rows_4_bit_pqs_codes_are_packed_as_the_index_keeps_them():
    """With 16 centroids (the default) ``pq_project`` writes the new row's codes two a byte, as ``encode`` packs
    them, over an odd count of sub-spaces (the last byte's high nibble 0)."""
    from oa_plugins.selectors.pq import encode

    keys, values, prefill, _ = make_inputs(tokens=140, dim=24)  # 3 sub-spaces of 8 dimensions: 2 bytes a key
    pipe = oa.build({**SPEC, "selector": {"name": "pq", "dims": 8, "rerank": 0}})
    state = StaticState.from_state(pipe.prepare(keys[:, :, :120], values[:, :, :120], prefill), 130)
    assert state.index.codes.shape[-1] == 2
    cache_k, cache_v = keys[:, :, :130].clone(), values[:, :, :130].clone()
    state.length += 1
    state.fused.run(state, keys[:, :, 120:121].repeat_interleave(3, 1), cache_k, cache_v)
    expected = encode(cache_k[:, :, 120:121], state.index.centroids)
    assert torch.equal(state.index.codes[:, :, 120:121], expected)
    assert not (expected[..., -1] >> 4).any()


def test_generate_through_the_fused_step_gives_the_default_caches_logits():
    """The fused step inside transformers: ``generate`` on the static cache — eagerly, and compiled in one graph
    (``aot_eager``, fullgraph) — gives the default cache's logits and tokens, every layer on the fused step."""
    from transformers import CompileConfig

    from test_integration import SPARSE, tiny_llama
    from test_static_cache import generate, padded_batch

    model, (ids, mask) = tiny_llama(), padded_batch()
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True
    with oa.patch(model, {**SPARSE, "kernel": "flash"}) as handle:  # the default's components (PQS)
        tokens, scores = generate(model, ids, mask, 3)
        cache = handle.static_cache(max_new_tokens=3)
        fast_tokens, fast_scores = generate(model, ids, mask, 3, cache=cache)
        assert all(layer.state is not None and layer.state.fused is not None for layer in cache.layers)
        assert "the kernel's fused step, PQS's shortlist by Triton (not a CUDA device)" in handle.stats.summary()
        _, compiled = generate(model, ids, mask, 3, cache=handle.static_cache(max_new_tokens=3), compile_config=config)
    torch.testing.assert_close(fast_scores, scores, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled, scores, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast_tokens, tokens)


def test_the_fused_step_takes_one_decode_query_per_row():
    keys, values, prefill, _ = make_inputs(tokens=140)
    pipe = oa.build(SPEC)
    state = StaticState.from_state(pipe.prepare(keys[:, :, :120], values[:, :, :120], prefill), 130)
    state.length += 1
    with pytest.raises(ValueError, match="one decode query per row, got 2"):
        state.fused.run(state, prefill[:, :, :2], keys[:, :, :130], values[:, :, :130])


def test_the_shortlist_counts_the_row_leaving_the_window_as_joined_before_its_join():
    """Whether the leaving row's cluster is written yet or not (the prologue joins it before the shortlist; a step
    laid out otherwise may not), the shortlist is the same, and holds that row when it scores best."""
    keys, values, prefill, _ = make_inputs(tokens=120)
    pipe = oa.build({**SPEC, "gqa": "per_head", **TWO_STAGE})
    state = StaticState.from_state(pipe.prepare(keys, values, prefill), 130)
    state.length += 1  # one step: slot 120 written, slot 120 - local leaves the window
    B, H, _, D = keys.shape
    Hq = prefill.shape[1]
    cache = torch.cat([keys, keys[:, :, -10:]], dim=2)
    leaving = 120 - SPEC["local"]
    scores = torch.randn(B * Hq, 130, generator=torch.Generator().manual_seed(3))
    scores[:, leaving] = 50.0  # the best score of every row
    query = torch.randn(B, Hq, 1, D)
    step = state.fused.two_stage
    args = (state.length, state.start, state.fused.density, state.fused.fixed, state.fused.tokens)
    before = step.shortlist(scores.clone(), cache, query, state, args, Hq // H, 1, SPEC["local"])
    assert int(state.assignment[0, 0, leaving]) == state.num_clusters  # not joined yet
    state.assignment[:, :, leaving] = 0
    after = step.shortlist(scores.clone(), cache, query, state, args, Hq // H, 1, SPEC["local"])
    (listed, exact, counts), (listed_after, exact_after, counts_after) = before[:3], after[:3]
    cut, cut_after = (before.cut, before.ties, before.places), (after.cut, after.ties, after.places)
    assert torch.equal(counts, counts_after) and all(torch.equal(a, b) for a, b in zip(cut, cut_after))
    for row, n in enumerate(counts.tolist()):  # entries past a row's count are never written
        assert leaving in listed[row, :n].tolist()
        assert torch.equal(listed[row, :n], listed_after[row, :n]) and torch.equal(exact[row, :n], exact_after[row, :n])


def test_a_key_rank_basis_runs_through_the_fused_step():
    """QGS's ``key_rank``: the fused step projects and scores on the basis the selector built, whatever its columns
    came from: the reference's rows and output, step for step."""
    steps, composed, fused = run_fused({**SPEC, "selector": {**SPEC["selector"], "key_rank": 4}}, steps=4)
    for ref_rows, rows, ref_out, out in steps:
        assert rows == ref_rows
        assert relative_error(out, ref_out) < 1e-4
    assert_same_state(composed, fused)


@pytest.mark.parametrize("dim", [80])
def test_a_head_dim_that_is_no_power_of_two_reads_the_same_rows(dim):
    """Phi-2's head dim: the kernels' tiles pad D to a power of two and mask the rest."""
    steps, composed, fused = run_fused({**SPEC, **PQS_TWO_STAGE}, tokens=140, steps=2, dim=dim)
    for ref_rows, rows, ref_out, out in steps:
        assert rows == ref_rows
        assert relative_error(out, ref_out) < 1e-4
    assert_same_state(composed, fused)
