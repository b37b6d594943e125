"""The fast decode path's state (oa_core.static) against the reference pipeline: the same rows read and the same
output at every step, with GQA, a batch with a left-padded row, growth across the local window's edge and a cache
filled to its capacity."""

import pytest
import torch

import oa_core as oa
from conftest import make_inputs, relative_error
from oa_core.static import StaticState, StaticUnsupported

SPEC = {"clusterer": {"name": "qgc", "num_clusters": 8}, "sink": 4, "local": 16, "budget": {"density": 0.2}}


def _rows(selection):
    """Each (batch row, KV head, selection head, query)'s rows read, as sets."""
    index = selection.index
    return [sorted(i for i in row.tolist() if i >= 0) for row in index.reshape(-1, index.shape[-1])]


def run_both(spec, tokens=180, steps=24, room=0, padded=True, seed=0):
    """Prepare one state for the reference pipeline and one static state, then decode ``steps`` tokens through both
    → per step (reference rows, static rows, reference output, static output)."""
    keys, values, prefill, _ = make_inputs(tokens=tokens + steps, seed=seed)
    B, H, _, D = keys.shape
    Hq = prefill.shape[1]
    mask = torch.ones(B, tokens, dtype=torch.bool)
    if padded:
        mask[1, :30] = False
    pipe = oa.build(spec)
    reference = pipe.prepare(keys[:, :, :tokens], values[:, :, :tokens], prefill, mask=mask)
    capacity = tokens + steps + room
    static = StaticState.from_state(
        pipe.prepare(keys[:, :, :tokens], values[:, :, :tokens], prefill, mask=mask), capacity
    )
    cache_k, cache_v = keys.new_zeros(B, H, capacity, D), values.new_zeros(B, H, capacity, D)
    cache_k[:, :, :tokens], cache_v[:, :, :tokens] = keys[:, :, :tokens], values[:, :, :tokens]
    gen = torch.Generator().manual_seed(seed + 1)
    results = []
    for step in range(steps):
        n = tokens + step
        reference.append(keys[:, :, n : n + 1], values[:, :, n : n + 1])
        cache_k[:, :, n], cache_v[:, :, n] = keys[:, :, n], values[:, :, n]
        static.length += 1
        query = keys[:, torch.arange(Hq) // (Hq // H), n : n + 1] * 1.1 + 0.3 * torch.randn(B, Hq, 1, D, generator=gen)
        static.grow(cache_k, cache_v)
        results.append(
            (
                _rows(pipe.explain(query, reference).selection),
                _rows(static.selection(query, cache_k)),
                pipe.attend(query, reference),
                static.attend(query, cache_k, cache_v),
            )
        )
    return results


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
@pytest.mark.parametrize("tail", ["proxy", "discard"])
def test_each_step_reads_the_reference_rows_and_gives_its_output(gqa, tail):
    for ref_rows, rows, ref_out, out in run_both({**SPEC, "gqa": gqa, "tail": tail, "kernel": "torch"}):
        assert rows == ref_rows
        assert relative_error(out, ref_out) < 1e-5


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_the_two_stage_selection_and_the_errorgate_floor_read_the_reference_rows_too(gqa):
    spec = {
        **SPEC,
        "gqa": gqa,
        "kernel": "torch",
        "selector": {"name": "qgs", "params": {"rerank": 3}},
        "allocator": {"name": "errorgate", "params": {"floor": 0.5}},
    }
    for ref_rows, rows, ref_out, out in run_both(spec, steps=12):
        assert rows == ref_rows
        assert relative_error(out, ref_out) < 1e-5


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_pqs_codes_grown_in_place_read_the_reference_rows(gqa):
    """PQS on the fast path: each new row coded into the static index (``token_codes``) as the reference appends it,
    and selectable once it leaves the local window (24 steps past a window of 16)."""
    spec = {
        **SPEC,
        "gqa": gqa,
        "kernel": "torch",
        "selector": {"name": "pq", "params": {"dims": 2, "bits": 4}},
        "allocator": {"name": "errorgate", "params": {"floor": 0.5}},
    }
    for ref_rows, rows, ref_out, out in run_both(spec, steps=24):
        assert rows == ref_rows
        assert relative_error(out, ref_out) < 1e-5


def test_the_triton_path_matches_too():
    """Under the interpreter: the default selector's kernel (PQS), ErrorGate's fused allocation, the member-list
    selection and flash (QGS's kernel on this path: tests/test_flash_step.py)."""
    if not oa.available()["kernel"] or "flash" not in oa.available()["kernel"]:
        pytest.skip("no flash kernel")
    from oa_plugins.allocators import errorgate

    previous, errorgate.INTERPRET_ON_CPU = errorgate.INTERPRET_ON_CPU, True
    try:
        for ref_rows, rows, ref_out, out in run_both({**SPEC, "kernel": "flash"}, tokens=140, steps=20):
            assert rows == ref_rows
            assert relative_error(out, ref_out) < 1e-4
    finally:
        errorgate.INTERPRET_ON_CPU = previous


def test_the_clustered_slots_are_one_range_from_the_sink_to_the_row_leaving_the_window():
    """The fused kernels test [start + sink, length − 1 − local] instead of reading ``assignment`` per slot: the
    prefill's clusters and every row that joins since (a left-padded row's range starts later) hold exactly that."""
    tokens, steps, room = 180, 30, 10
    keys, values, prefill, _ = make_inputs(tokens=tokens + steps)
    B, H = keys.shape[:2]
    mask = torch.ones(B, tokens, dtype=torch.bool)
    mask[1, :30] = False
    pipe = oa.build({**SPEC, "kernel": "torch"})
    state = pipe.prepare(keys[:, :, :tokens], values[:, :, :tokens], prefill, mask=mask)
    static = StaticState.from_state(state, tokens + steps + room)
    keys, values = (torch.cat([t, t.new_zeros(*t.shape[:2], room, t.shape[-1])], dim=2) for t in (keys, values))
    positions = torch.arange(static.capacity)
    for step in range(steps + 1):
        n = int(static.length)
        lowest = static.start[:, None, None] + SPEC["sink"]
        expected = (positions >= lowest) & (positions <= n - 1 - SPEC["local"])
        assert torch.equal(static.assignment != static.num_clusters, expected.expand(B, H, -1)), step
        if step < steps:
            static.length += 1
            static.grow(keys, values)


def test_a_cache_filled_to_capacity_and_one_with_room_agree():
    full = run_both({**SPEC, "kernel": "torch"}, steps=12)
    roomy = run_both({**SPEC, "kernel": "torch"}, steps=12, room=50)
    for (_, rows_a, _, out_a), (_, rows_b, _, out_b) in zip(full, roomy):
        assert rows_a == rows_b and torch.allclose(out_a, out_b, atol=1e-6)


def test_what_the_fast_path_cannot_hold_is_refused_with_the_reason():
    keys, values, prefill, _ = make_inputs(tokens=100)
    dense = oa.build({**SPEC, "budget": {"tokens": 1000}})
    with pytest.raises(StaticUnsupported, match="budget covers its context"):
        StaticState.from_state(dense.prepare(keys, values, prefill), 120)
    sampled = oa.build({**SPEC, "tail": "sample"})
    with pytest.raises(StaticUnsupported, match="tail: sample"):
        StaticState.from_state(sampled.prepare(keys, values, prefill), 120)
    quest = oa.build({**SPEC, "selector": "quest"})
    with pytest.raises(StaticUnsupported, match="selector 'quest' has no per-token codes"):
        StaticState.from_state(quest.prepare(keys, values, prefill), 120)
    with pytest.raises(ValueError, match="capacity: 90 slots cannot hold the 100 tokens"):
        StaticState.from_state(oa.build(SPEC).prepare(keys, values, prefill), 90)


@pytest.mark.parametrize("kernel", ["torch", "flash"])
def test_a_step_on_a_cache_of_another_shape_is_refused_before_it_reads(kernel):
    """The kernels address a slot as (batch row · head) · capacity + slot: a cache with fewer slots than the state's
    capacity, or a strided view of one, would be read at the wrong rows (past its end for the last heads)."""
    keys, values, prefill, _ = make_inputs(tokens=100)
    B, H, _, D = keys.shape
    static = StaticState.from_state(oa.build({**SPEC, "kernel": kernel}).prepare(keys, values, prefill), 120)
    short = keys.new_zeros(B, H, 110, D)
    roomy = keys.new_zeros(B, H, 120, D)
    query = torch.zeros(B, prefill.shape[1], 1, D)
    with pytest.raises(ValueError, match=rf"keys: a contiguous cache of .* = \[{B}, {H}, 120, D\] rows, not"):
        static.step(query, short, roomy)
    with pytest.raises(ValueError, match=r"values: .*\(not contiguous\)"):
        static.grow(roomy, roomy.transpose(0, 1).contiguous().transpose(0, 1))


def test_the_state_lives_in_one_buffer_and_a_copy_of_it_is_a_state_of_its_own():
    """A step takes a layer's state as two tensors (its length and the arena, every other tensor a view into it);
    over a copy of the arena (what a compiled op may be handed) a step writes the copy, and the copy's steps are the
    original's."""
    from oa_core.static import ALIGN, unpack

    keys, values, prefill, _ = make_inputs(tokens=150)
    pipe = oa.build({**SPEC, "kernel": "torch"})
    static = StaticState.from_state(pipe.prepare(keys[:, :, :120], values[:, :, :120], prefill), 150)
    length, arena = static.buffers()
    assert length is static.length and arena.dtype == torch.uint8 and arena.dim() == 1
    views = unpack(arena, static.layout)
    assert all(offset % ALIGN == 0 for offset, _, _ in static.layout.values())
    for view, mine in (
        (views["assignment"], static.assignment),
        (views["assignment"], static.clusters.assignment),  # no copy of the prepare's assignment kept beside it
        (views["key_sum"], static.pooled.key_sum),
        (views["members"], static.members),
        (views["codes"], static.index.codes),
    ):
        assert view.data_ptr() == mine.data_ptr() and view.dtype == mine.dtype and view.shape == mine.shape
    assert static.with_buffers([length, arena]) is static
    other = arena.clone()
    moved = static.with_buffers([length, other])
    assert (
        moved.assignment.data_ptr()
        == moved.clusters.assignment.data_ptr()
        == unpack(other, static.layout)["assignment"].data_ptr()
    )
    twin = static.with_buffers([length.clone(), arena.clone()])
    assert twin.pooled.count.data_ptr() != static.pooled.count.data_ptr()
    assert torch.equal(twin.pooled.count, static.pooled.count) and torch.equal(twin.start, static.start)
    cache_k, cache_v = (
        keys.new_zeros(*keys.shape[:2], 150, keys.shape[-1]),
        values.new_zeros(*values.shape[:2], 150, values.shape[-1]),
    )
    cache_k[:, :, :121], cache_v[:, :, :121] = keys[:, :, :121], values[:, :, :121]
    before = static.arena.clone()
    twin.length += 1
    twin.grow(cache_k, cache_v)
    assert torch.equal(static.arena, before), "the copy's step wrote the original"
    static.length += 1
    static.grow(cache_k, cache_v)
    assert torch.equal(static.arena, twin.arena) and not torch.equal(static.arena, before)
