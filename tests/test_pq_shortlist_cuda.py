"""PQS's scores and shortlist in one CUDA launch (``oa_plugins.kernels.pq_shortlist_cuda``): where it runs, why not
where it cannot, what the step declares; and on a GPU of sm_90 or later (skipped elsewhere: CI has none) its outputs
against the Triton launches it replaces and the fused step's rows against the reference pipeline's."""

import pytest
import torch

import oa_core as oa
from conftest import load_benchmark
from oa_core.ops import triton_path
from oa_core.static import StaticState
from oa_core.testing import make_inputs
from oa_core.testing.fused import selected_rows
from oa_plugins.kernels import pq_shortlist_cuda
from oa_plugins.kernels.flash_step import FusedStep, PQSScoring

DEFAULT = {
    "clusterer": {"name": "qgc", "num_clusters": 8},
    "selector": {"name": "pq", "rerank": 4},
    "allocator": {"name": "errorgate", "floor": 0.5},
    "sink": 4,
    "local": 16,
    "budget": {"density": 0.2},
    "kernel": "flash",
}
needs_cpu_triton = pytest.mark.skipif(not triton_path.interpreting(), reason="Triton on the CPU: TRITON_INTERPRET=1")
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
# On a GPU the Triton launches it is checked against must be compiled: TRITON_INTERPRET=0 python -m pytest <this file>
needs_sm90 = pytest.mark.skipif(
    not SM90 or triton_path.interpreting(), reason="needs a CUDA GPU of sm_90 or later, TRITON_INTERPRET=0"
)


@pytest.fixture(autouse=True)
def flash():
    if "flash" not in oa.available()["kernel"]:
        pytest.skip("no flash kernel (Triton)")


def _state(gqa="per_head", group=4, dim=32, device="cpu", dtype=torch.float32, tokens=140, capacity=150):
    """A prepared default-like state at ``capacity`` (one token appended: the step's length), its cache, a query."""
    keys, values, prefill, _ = make_inputs(tokens=tokens + 1, group=group, dim=dim, dtype=dtype)
    keys[:, :, 70:100] = keys[:, :, 40:70]  # tied codes and logits
    mask = torch.ones(2, tokens, dtype=torch.bool)
    mask[1, :25] = False  # a left-padded row
    keys, values, prefill, mask = (t.to(device) for t in (keys, values, prefill, mask))
    pipe = oa.build({**DEFAULT, "gqa": gqa})
    prepared = pipe.prepare(keys[:, :, :tokens], values[:, :, :tokens], prefill, mask=mask)
    state = StaticState.from_state(prepared, capacity)
    B, H, _, D = keys.shape
    cache_k = keys.new_zeros(B, H, capacity, D)
    cache_k[:, :, : tokens + 1] = keys
    state.length += 1
    query = keys[:, torch.arange(H * group, device=device) // group, tokens : tokens + 1] * 1.1
    return state, cache_k, query


@needs_cpu_triton
def test_on_the_cpu_the_step_keeps_tritons_launches_and_says_why():
    state, _, _ = _state()
    fused = state.fused
    assert fused.shortlist_note == "not a CUDA device" and not fused.shortlist_cuda
    assert fused.note == "the kernel's fused step, PQS's shortlist by Triton (not a CUDA device)"  # the run's records
    assert "pq_shortlist" not in fused.launches(state) and "pq_scores" in fused.launches(state)


@needs_cpu_triton
def test_oa_cuda_0_turns_it_off_and_other_selectors_never_take_it(monkeypatch):
    state, _, _ = _state()
    monkeypatch.setenv("OA_CUDA", "0")
    assert pq_shortlist_cuda.unavailable_reason(state) == "OA_CUDA=0"
    qgs = StaticState.from_state(
        oa.build({**DEFAULT, "selector": {"name": "qgs", "rerank": 4}}).prepare(*make_inputs(tokens=120)[:3]),
        130,
    )
    assert qgs.fused is not None and "PQS's two-stage selection only" in qgs.fused.shortlist_note


@needs_cpu_triton
def test_a_launch_refuses_keys_and_layouts_the_kernel_does_not_take():
    """Before the library is touched: keys of another dtype than float32/16 and bfloat16, a query of another dtype
    than the keys', scores that are not one dense block."""
    state, cache_k, query = _state()
    fused = state.fused
    budget_args = (state.length, state.start, fused.density, fused.fixed, fused.tokens)
    tables = fused.prologue(state, query, cache_k, torch.zeros_like(cache_k))[0]  # (the state grows: one step's)
    scores = torch.empty(2 * 2 * 4, 150)
    args = (fused.two_stage, state, tables)
    with pytest.raises(ValueError, match=r"keys torch.float64, query torch.float64 \(one of float32"):
        pq_shortlist_cuda.launch(*args, scores, cache_k.double(), query.double(), budget_args, 4, 1)
    with pytest.raises(ValueError, match=r"keys torch.float32, query torch.float16"):
        pq_shortlist_cuda.launch(*args, scores, cache_k, query.half(), budget_args, 4, 1)
    with pytest.raises(ValueError, match="the tables and scores contiguous"):
        pq_shortlist_cuda.launch(*args, torch.empty(150, 16).T, cache_k, query, budget_args, 4, 1)


def test_the_default_step_declares_the_cuda_launches_for_the_three():
    triton = FusedStep.launch_names(PQSScoring, rerank=True, floor=True, classes=1)
    assert len(triton) == 7
    cuda = FusedStep.launch_names(PQSScoring, rerank=True, floor=True, classes=1, cuda=True)
    names = ["pq_shortlist", "exact_logits"]
    assert [n for n in triton if n not in PQSScoring.SHORTLIST] == [n for n in cuda if n not in names]
    assert len(cuda) == 6 and cuda.count("pq_shortlist") == 1


def test_the_wrapper_passes_the_arguments_the_source_declares_in_its_order():
    """The .cu's ``oa_pq_shortlist`` against ``SIGNATURE`` (names, pointers, ints, the float): where no GPU runs the
    kernel, a parameter added or dropped on one side only would pass every other test."""
    import ctypes
    import re

    source = pq_shortlist_cuda.SOURCE.read_text()
    declared = re.search(r"int oa_pq_shortlist\((.*?)\)\s*\{", source, re.DOTALL)
    assert declared is not None
    kinds = {"int": ctypes.c_int, "float": ctypes.c_float}
    parameters = []
    for parameter in declared.group(1).split(","):
        words = parameter.replace("*", " * ").split()
        parameters.append((words[-1], ctypes.c_void_p if "*" in words else kinds[words[-2]]))
    assert parameters == list(pq_shortlist_cuda.SIGNATURE)
    arguments = {name: index for index, (name, _) in enumerate(pq_shortlist_cuda.SIGNATURE)}
    values = pq_shortlist_cuda.call_arguments(arguments)
    assert [type(v) for v in values] == [kind for _, kind in pq_shortlist_cuda.SIGNATURE]
    assert [v.value for v in values][1:] == pytest.approx(list(range(1, len(values))))  # in the source's order
    with pytest.raises(ValueError, match=r"missing \['stream'\], unknown \['steam'\]"):
        pq_shortlist_cuda.call_arguments({**{k: v for k, v in arguments.items() if k != "stream"}, "steam": 0})


def test_without_nvcc_the_library_says_so(monkeypatch):
    monkeypatch.setattr(pq_shortlist_cuda, "nvcc", lambda: None)
    pq_shortlist_cuda.library.cache_clear()
    try:
        assert "no nvcc found" in pq_shortlist_cuda.library((9, 0))
    finally:
        pq_shortlist_cuda.library.cache_clear()


@pytest.mark.skipif(pq_shortlist_cuda.nvcc() is None, reason="no nvcc")
def test_the_kernel_compiles_for_sm_90(tmp_path, monkeypatch, capsys):
    """nvcc takes the source, saying so first (the library is cached by its source's hash: a second call loads it)."""
    monkeypatch.setenv("OA_NATIVE_CACHE", str(tmp_path))
    pq_shortlist_cuda.library.cache_clear()
    try:
        lib = pq_shortlist_cuda.library((9, 0))
        assert "compiling the CUDA shortlist for sm_90" in capsys.readouterr().err
        assert not isinstance(lib, str), lib
        smem = lib.oa_pq_shortlist_smem  # (heads, rows, M, CC, capacity, blocks): a block's 2048 positions here
        assert smem(4, 4, 64, 16, 16384, 8) == 4 * (4 * 64 * 16 + 4 * 2048 + 2 * 4 * 256)
        assert len(list(tmp_path.glob("oa_pq_shortlist_*.so"))) == 1
    finally:
        pq_shortlist_cuda.library.cache_clear()


def _both(gqa, group, dim, device, dtype):
    """The Triton launches' shortlist and the CUDA launch's (None on the CPU) on one state, with what they need."""
    state, cache_k, query = _state(gqa, group, dim, device, dtype)
    fused = state.fused
    Gs, G = (1, group) if gqa == "shared" else (group, 1)
    rows, cap = cache_k.shape[0] * cache_k.shape[1] * Gs, cache_k.shape[2]
    budget_args = (state.length, state.start, fused.density, fused.fixed, fused.tokens)
    tables = fused.prologue(state, query, cache_k, torch.zeros_like(cache_k))[0]  # (the state grows: one step's)
    three = torch.full((rows, cap), float("nan"), device=device)
    expected = fused.two_stage.pq_shortlist(tables, state, three, cache_k, query, budget_args, Gs, G)
    got, one = None, None
    if device == "cuda":
        assert fused.shortlist_cuda, fused.shortlist_note
        one = torch.full_like(three, float("nan"))
        got = pq_shortlist_cuda.launch(fused.two_stage, state, tables, one, cache_k, query, budget_args, Gs, G)
        torch.cuda.synchronize()
    return (state, tables, cache_k, query, Gs, G), (expected, three), (got, one)


@needs_cpu_triton
def test_the_listing_check_passes_tritons_shortlist_and_catches_each_fault():
    """``listing_faults`` (what the GPU tests and the phases study check the CUDA launch by) finds nothing wrong with
    the Triton launches' shortlist, and finds each fault made in it: a box moved, an entry given to an unlisted position
    or lost, an exact logit off, a score off, the order broken."""
    check = load_benchmark("pq_shortlist_phases").listing_faults
    inputs, (listing, scores), _ = _both("per_head", 4, 32, "cpu", torch.float32)
    assert set(check(*inputs, listing, scores, listing.counts).values()) == {0}

    def broken(change):
        bad_listing = listing._replace(listed=listing.listed.clone(), exact=listing.exact.clone())
        bad_scores = scores.clone()
        change(bad_listing, bad_scores)
        return {k for k, v in check(*inputs, bad_listing, bad_scores, listing.counts).items() if v}

    def move_box(lst, sc):
        sc[0, int(lst.listed[0, 0]) + 0], sc[0, 139] = 1.0, sc[0, int(lst.listed[0, 0])]

    def drop_best(lst, sc):  # the best position's entry given to an unlisted one
        k = int(lst.counts[0])
        chosen = set(lst.listed[0, :k].tolist())
        outside = next(p for p in range(20, 120) if p not in chosen and sc[0, p] > float("-inf"))
        lst.listed[0, 0] = outside

    def drop_first(lst, sc):  # the first entry's position lost (listed twice instead): a key above the cut unlisted
        lst.listed[0, 0] = lst.listed[0, 1]

    def shift_exact(lst, sc):
        lst.exact[1, 2] += 0.5

    def shift_score(lst, sc):
        k = int(lst.counts[2])
        chosen = set(lst.listed[2, :k].tolist())
        p = next(p for p in range(20, 120) if p not in chosen and sc[2, p] > float("-inf"))
        sc[2, p] += 0.5

    def swap_order(lst, sc):
        lst.listed[3, [0, 1]] = lst.listed[3, [1, 0]]

    assert "boxes" in broken(move_box)
    assert {"selection", "boxes"} <= broken(drop_best)
    assert {"selection", "order"} <= broken(drop_first)
    assert broken(shift_exact) == {"exact"}
    assert broken(shift_score) == {"scores"}
    assert "order" in broken(swap_order)


@needs_sm90
@pytest.mark.parametrize(
    "gqa,group,dim,dtype",
    [
        ("per_head", 4, 32, torch.float32),
        ("shared", 4, 64, torch.float32),
        ("per_head", 1, 64, torch.float32),
        ("per_head", 4, 128, torch.bfloat16),
        ("shared", 3, 128, torch.float16),
    ],
)
def test_one_launch_lists_what_the_three_triton_launches_list(gqa, group, dim, dtype):
    """On one state, the CUDA launch's shortlist passes every check that the Triton launches' passes
    (``listing_faults``: lengths, order, boxes, scores, the selection at the cut, ties by position, the cut, exact
    logits), over tied keys, a left-padded row, codes of 8 and of 16 bytes or more (the kernel's two loads), float32,
    bfloat16 and float16 keys, groups of 1, 3 and 4 heads."""
    check = load_benchmark("pq_shortlist_phases").listing_faults
    inputs, (expected, three), (got, one) = _both(gqa, group, dim, "cuda", dtype)
    assert set(check(*inputs, expected, three, expected.counts).values()) == {0}
    assert check(*inputs, got, one, expected.counts) == dict.fromkeys(check(*inputs, got, one, expected.counts), 0)
    assert int(got.counts.min()) > 0 and int(got.ties.max()) > 0


@needs_sm90
@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_the_fused_step_with_it_reads_the_reference_rows(gqa):
    """Decoding eight tokens through the fused step (the CUDA shortlist in it) from a left-padded cache with tied
    keys, across the local window's edge to the cache's capacity: at every step the reference pipeline's rows, and
    its output."""
    steps, tokens, capacity = 8, 140, 148
    keys, values, prefill, _ = make_inputs(tokens=tokens + steps, group=4, dim=64)
    keys[:, :, 70:100] = keys[:, :, 40:70]
    mask = torch.ones(2, tokens, dtype=torch.bool)
    mask[1, :25] = False
    keys, values, prefill, mask = (t.cuda() for t in (keys, values, prefill, mask))
    pipe = oa.build({**DEFAULT, "gqa": gqa})
    reference = pipe.prepare(keys[:, :, :tokens], values[:, :, :tokens], prefill, mask=mask)
    prepared = pipe.prepare(keys[:, :, :tokens], values[:, :, :tokens], prefill, mask=mask)
    state = StaticState.from_state(prepared, capacity)
    assert state.fused is not None and state.fused.shortlist_cuda, state.fused.shortlist_note
    B, H, _, D = keys.shape
    cache_k, cache_v = keys.new_zeros(B, H, capacity, D), values.new_zeros(B, H, capacity, D)
    cache_k[:, :, :tokens], cache_v[:, :, :tokens] = keys[:, :, :tokens], values[:, :, :tokens]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(steps):
        n = tokens + step
        reference.append(keys[:, :, n : n + 1], values[:, :, n : n + 1])
        cache_k[:, :, n], cache_v[:, :, n] = keys[:, :, n], values[:, :, n]
        state.length += 1
        query = keys[:, torch.arange(4 * H, device="cuda") // 4, n : n + 1] * 1.1
        query = query + 0.3 * torch.randn(query.shape, generator=gen, device="cuda")
        out, selection = state.fused.run(state, query, cache_k, cache_v)
        expected = pipe.explain(query, reference).selection.index
        assert selected_rows(selection.index) == selected_rows(expected), f"step {step}"
        ref_out = pipe.attend(query, reference)
        assert float((out - ref_out).norm() / ref_out.norm()) < 1e-4
    assert "pq_shortlist" in state.fused.launches(state)
