"""OpenAttention.flash against the torch reference, under the Triton interpreter on the CPU (issue: flash kernel).

Each case builds a real selection and real pooled sums with the pipeline, then feeds the same inputs to both
kernels. Shapes are small: the interpreter runs every program in Python.
"""

import math
import os

import pytest
import torch

pytest.importorskip("triton")

import oa_core as oa
from conftest import make_inputs  # conftest sets TRITON_INTERPRET=1 before any kernel is defined
from oa_core.components import Selection
from oa_core.ops import triton_path
from oa_plugins.kernels.flash import FlashKernel, block_columns
from oa_plugins.kernels.reference import TorchKernel

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the CPU run of the Triton kernels needs TRITON_INTERPRET=1 from the start",
)


def _case(
    tokens=203,
    batch=2,
    kv_heads=2,
    group=3,
    dim=32,
    queries=2,
    gqa="per_head",
    tail="proxy",
    density=0.15,
    clusters=8,
    dtype=torch.float32,
    seed=0,
    proxy="second-order",
):
    keys, values, prefill, decode = make_inputs(
        batch=batch, kv_heads=kv_heads, group=group, tokens=tokens, dim=dim, queries=queries, seed=seed
    )
    pipe = oa.build(
        {
            "kernel": "torch",
            "gqa": gqa,
            "tail": tail,
            "proxy": proxy,
            "sink": 4,
            "local": 16,
            "seed": seed,
            "budget": {"density": density},
            "clusterer": {"name": "qgc", "num_clusters": clusters},
        }
    )
    state = pipe.prepare(keys, values, prefill)
    selection = pipe.explain(decode, state).selection
    proxies = pipe.tail_proxies(state.pooled)
    cast = [t.to(dtype) for t in (decode, keys, values)]
    return (*cast, selection, proxies, 1 / math.sqrt(dim))


def _compare(case, tolerance, **partition):
    query, keys, values, selection, proxies, scale = case
    reference, used_ref = TorchKernel().attend(query, keys, values, selection, proxies, scale)
    kernel = FlashKernel()
    for knob, value in partition.items():  # block_k, clusters_per_chunk, free_splits
        assert hasattr(kernel, knob)
        setattr(kernel, knob, value)
    kernel.poison = True  # NaN in every buffer first: a value the kernels do not write shows up
    out, used = kernel.attend(query, keys, values, selection, proxies, scale)
    assert kernel.note.startswith("triton")
    assert out.dtype == query.dtype and out.shape == query.shape and bool(torch.isfinite(out).all())
    error = float((out.double() - reference.double()).norm() / reference.double().norm())
    assert error < tolerance, error
    if proxies is not None:
        assert torch.equal(used.long(), used_ref.long())
    return error


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
@pytest.mark.parametrize("tail", ["proxy", "discard", "sample"])
def test_flash_matches_the_reference_fp32(gqa, tail):
    _compare(_case(gqa=gqa, tail=tail), 1e-4)


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_flash_matches_the_reference_with_mean_proxies(gqa):
    case = _case(gqa=gqa, proxy="mean")
    assert not case[4].second_order
    _compare(case, 1e-4)
    # and the two proxies differ on these inputs: the second-order term is computed, not dropped
    query, keys, values, selection, proxies, scale = _case(gqa=gqa)
    assert proxies.second_order
    mean, _ = FlashKernel().attend(*case)
    second, _ = FlashKernel().attend(query, keys, values, selection, proxies, scale)
    assert float((mean - second).norm() / second.norm()) > 1e-3


@pytest.mark.parametrize("tail", ["proxy", "discard"])
def test_the_gpu_partition_of_rows_into_programs(tail):
    # The GPU's split: 40 clusters in chunks of 16 (the last one partial) or 32, runs longer than a block; the free
    # columns (all of them without proxies) in one program per row or split over several, some with nothing to read.
    case = _case(gqa="shared", tail=tail, batch=1, tokens=400, clusters=40, density=0.3)
    _compare(case, 1e-4, clusters_per_chunk=16, block_k=16)
    _compare(case, 1e-4, clusters_per_chunk=16, free_splits=1, block_k=16)
    _compare(case, 1e-4, clusters_per_chunk=32, free_splits=9, block_k=32)


def test_free_columns_that_do_not_divide_evenly_among_the_chunks():
    # With proxies each chunk's program reads a share of the free columns (the sink, the window, the padding after the
    # runs). Cut the padding off so that a row's free columns are its 20 sink and window rows alone, shared by 3
    # chunks: the last share is shorter, and every one of them holds rows. The queries are the newest keys (the
    # window's last rows, the free sequence's last columns), so that a column left unread shows.
    query, keys, values, selection, proxies, scale = _case(gqa="shared", batch=1, tokens=400, clusters=40, density=0.3)
    heads = torch.arange(query.shape[1]) // (query.shape[1] // keys.shape[1])
    query = 0.5 * keys[:, heads, -query.shape[2] :] / scale**0.5
    columns = torch.arange(selection.index.shape[-1])
    width = int(torch.where(selection.index >= 0, columns, -1).amax()) + 1
    cut = Selection(
        selection.index[..., :width].contiguous(), selection.log_weight[..., :width].contiguous(), selection.runs
    )
    runs = cut.runs.reshape(-1, cut.runs.shape[-1])
    free = runs[:, 0] + width - runs[:, -1]
    assert int(free.min()) == 20 and 20 % 3 != 0  # a row without padding: 3 chunks of 16 share 20 columns
    _compare((query, keys, values, cut, proxies, scale), 1e-4, clusters_per_chunk=16, block_k=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_matches_the_reference_half(dtype):
    _compare(_case(dtype=dtype, gqa="shared"), 1e-2)


def test_ragged_clusters_and_clusters_read_in_full():
    # 40% of a short context with many small clusters: most clusters are read in full (no proxy), the rest ragged.
    query, keys, values, selection, proxies, scale = _case(tokens=90, density=0.6, clusters=12, seed=3)
    counts = proxies.count
    assert counts.max() > 2 * counts.min()  # ragged sizes
    error = _compare((query, keys, values, selection, proxies, scale), 1e-4)
    _, used = TorchKernel().attend(query, keys, values, selection, proxies, scale)
    assert int(used.min()) < proxies.count.shape[-1]  # some cluster had no tail left
    assert error < 1e-4


def test_empty_selection_rows_and_padding():
    query, keys, values, selection, proxies, scale = _case(tokens=150, seed=4)
    index = selection.index.clone()
    # One selection row keeps only its first row: the rest is padding (-1), as in a short or causal row.
    index[0, 0, 0, 0, 1:] = -1
    # A whole block of padding at the end of every row: K beyond a multiple of the block size.
    pad = torch.full((*index.shape[:-1], 70), -1)
    selection = Selection(torch.cat([index, pad], -1), torch.cat([selection.log_weight, pad.float() * 0], -1))
    _compare((query, keys, values, selection, proxies, scale), 1e-4)


@pytest.mark.parametrize("tokens", [97, 130])
def test_lengths_not_a_multiple_of_the_block(tokens):
    assert tokens % block_columns(64)
    _compare(_case(tokens=tokens, density=0.5, batch=3, kv_heads=1, group=4, seed=5), 1e-4)


def test_the_pass_counts_its_parts_on_zeros_it_is_given_and_refuses_others():
    """``FlashKernel.sparse`` takes the row counters its parts count their arrival on (the fused step's, which its plan
    zeroes): zeros give ``attend``'s output; a counter of another length, dtype or device is refused, by name."""
    query, keys, values, selection, proxies, scale = _case()
    kernel = FlashKernel()
    expected, _ = kernel.attend(query, keys, values, selection, proxies, scale)
    rows = selection.index[..., 0].numel()
    out, _ = kernel.sparse(query, keys, values, selection, proxies, scale, torch.zeros(rows, dtype=torch.int32))
    assert torch.equal(out, expected)
    for bad in (torch.zeros(rows + 1, dtype=torch.int32), torch.zeros(rows, dtype=torch.int64)):
        with pytest.raises(ValueError, match=rf"flash: arrivals must be int32 \[{rows}\] on cpu, got"):
            kernel.sparse(query, keys, values, selection, proxies, scale, bad)


def test_dense_attend_and_fallback_reason(monkeypatch):
    query, keys, values, _, _, scale = _case()
    kernel = FlashKernel()
    dense, _ = kernel.attend(query, keys, values, None, None, scale)
    reference, _ = TorchKernel().attend(query, keys, values, None, None, scale)
    assert torch.allclose(dense, reference, atol=1e-5)
    monkeypatch.setattr(triton_path, "interpreting", lambda: False)
    out, _ = kernel.attend(query, keys, values, None, None, scale)
    assert kernel.note.startswith("torch reference: no CUDA device")
    assert torch.equal(out, reference)


def test_pipeline_with_flash_reports_the_kernel():
    keys, values, prefill, decode = make_inputs(batch=2, kv_heads=2, group=2, tokens=160, seed=6)
    spec = {"sink": 4, "local": 16, "budget": {"density": 0.2}, "clusterer": {"name": "qgc", "num_clusters": 8}}
    flash_pipe, torch_pipe = oa.build({**spec, "kernel": "flash"}), oa.build({**spec, "kernel": "torch"})
    out, stats = flash_pipe.attend(decode, flash_pipe.prepare(keys, values, prefill), return_stats=True)
    ref = torch_pipe.attend(decode, torch_pipe.prepare(keys, values, prefill))
    assert "flash" in stats.kernel and "triton" in stats.kernel
    assert float((out - ref).norm() / ref.norm()) < 1e-4


def test_a_head_dim_of_256_takes_smaller_blocks_and_the_same_rows():
    """Gemma-3's head dim: blocks of ``block_columns(256)`` = 16 columns (64 spilled 18 KB a thread on an sm_90),
    with rows equal to the reference's."""
    assert block_columns(256) == 16 and block_columns(64) == 64
    _compare(_case(tokens=150, batch=1, kv_heads=1, group=4, dim=256, density=0.3, seed=7), 1e-4)


def test_logit_stats_of_another_shape_are_refused():
    query, keys, values, selection, proxies, scale = _case(queries=1)
    B, Hq, _, _ = query.shape
    Hkv, C = keys.shape[1], proxies.count.shape[-1]
    wrong = torch.zeros(B, Hkv, Hq // Hkv, 1, C + 1)
    with pytest.raises(ValueError, match=r"logit_stats must be float32 \[2, 2, 3, 1, 8\]"):
        FlashKernel().sparse(query, keys, values, selection, proxies, scale, logit_stats=(wrong, wrong))


def test_the_given_logit_stats_replace_the_sums_they_come_from():
    """The fused step's statistics (z̄_b, σ̂_b² per head, as its prologue computes them): the same output as the
    pass that reads Σk and Σk⊙k, to float rounding, per head and shared."""
    from oa_core.ops.cluster_stats import moments_from_sums

    for gqa in ("per_head", "shared"):
        query, keys, values, selection, proxies, scale = _case(queries=1, gqa=gqa)
        B, Hq, _, D = query.shape
        Hkv = keys.shape[1]
        mean, variance = moments_from_sums(proxies.count, proxies.key_sum, proxies.key_square_sum)
        q = query.float().view(B, Hkv, Hq // Hkv, 1, D)
        stats = (
            scale * q @ mean[:, :, None].transpose(-1, -2),
            scale**2 * (q * q) @ variance[:, :, None].transpose(-1, -2),
        )
        plain, _ = FlashKernel().sparse(query, keys, values, selection, proxies, scale)
        given, _ = FlashKernel().sparse(query, keys, values, selection, proxies, scale, logit_stats=stats)
        torch.testing.assert_close(given, plain, rtol=1e-5, atol=1e-6)
