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
    static = StaticState.from_state(pipe.prepare(keys[:, :, :tokens], values[:, :, :tokens], prefill, mask=mask),
                                    capacity)
    cache_k, cache_v = keys.new_zeros(B, H, capacity, D), values.new_zeros(B, H, capacity, D)
    cache_k[:, :, :tokens], cache_v[:, :, :tokens] = keys[:, :, :tokens], values[:, :, :tokens]
    gen = torch.Generator().manual_seed(seed + 1)
    results = []
    for step in range(steps):
        n = tokens + step
        reference.append(keys[:, :, n:n + 1], values[:, :, n:n + 1])
        cache_k[:, :, n], cache_v[:, :, n] = keys[:, :, n], values[:, :, n]
        static.length += 1
        query = keys[:, torch.arange(Hq) // (Hq // H), n:n + 1] * 1.1 + 0.3 * torch.randn(B, Hq, 1, D, generator=gen)
        static.grow(cache_k, cache_v)
        results.append((_rows(pipe.explain(query, reference).selection), _rows(static.selection(query, cache_k)),
                        pipe.attend(query, reference), static.attend(query, cache_k, cache_v)))
    return results


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
@pytest.mark.parametrize("tail", ["proxy", "discard"])
def test_each_step_reads_the_reference_rows_and_gives_its_output(gqa, tail):
    for ref_rows, rows, ref_out, out in run_both({**SPEC, "gqa": gqa, "tail": tail, "kernel": "torch"}):
        assert rows == ref_rows
        assert relative_error(out, ref_out) < 1e-5


def test_the_triton_path_matches_too():
    """Under the interpreter: the QGS kernel, ErrorGate's fused allocation, the member-list selection and flash."""
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
