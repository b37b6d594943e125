"""Every bad input of DEVELOPERS.md's list gets a clear error naming what is wrong (spec fields: test_spec.py)."""

import math

import pytest
import torch

import oa_core as oa
from conftest import make_inputs
from oa_core.state import CacheMismatch

SPEC = {"clusterer": {"name": "qgc", "num_clusters": 8}, "sink": 4, "local": 16, "budget": {"density": 0.2}}


@pytest.fixture
def pipe():
    return oa.build(SPEC)


def test_a_token_budget_smaller_than_sink_and_local_is_an_error_of_the_spec():
    with pytest.raises(oa.SpecError, match=r"^budget\.tokens: 19 rows is smaller than sink \+ local = 4 \+ 16 = 20"):
        oa.build({**SPEC, "budget": {"tokens": 19}})
    assert oa.build({**SPEC, "budget": {"tokens": 20}}).spec.budget.tokens == 20


def test_a_density_too_small_for_sink_and_local_on_a_short_context_reads_it_densely_and_says_why(inputs):
    keys, values, prefill, query = inputs
    N = keys.shape[2]
    pipe = oa.build({**SPEC, "budget": {"density": 0.01}})  # 1% of the context: fewer rows than sink + local
    state = pipe.prepare(keys, values, prefill)
    out, stats = pipe.attend(query, state, return_stats=True)
    assert stats.dense and stats.reason == f"dense: budget of {N // 100} rows (1.0% of {N} tokens) < sink + local = 20"
    full = oa.build({**SPEC, "budget": {"density": 1.0}})
    assert torch.allclose(out, full.attend(query, full.prepare(keys, values, prefill)), atol=1e-5)


@pytest.mark.parametrize("where", ["keys", "values"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_in_the_cache(pipe, inputs, where, bad):
    keys, values, prefill, _ = inputs
    tensors = {"keys": keys.clone(), "values": values.clone()}
    tensors[where][1, 0, 17, 3] = bad
    with pytest.raises(ValueError, match=rf"{where}: the cache contains NaN or Inf"):
        pipe.prepare(tensors["keys"], tensors["values"], prefill)


def test_nan_in_appended_rows(pipe, inputs):
    keys, values, prefill, _ = inputs
    state = pipe.prepare(keys, values, prefill)
    new = keys[:, :, :2].clone()
    new[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="appended keys: the cache contains NaN or Inf"):
        state.append(new, values[:, :, :2])


def test_nan_in_the_query(pipe, inputs):
    keys, values, prefill, decode = inputs
    state = pipe.prepare(keys, values, prefill)
    decode = decode.clone()
    decode[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="query: contains NaN or Inf"):
        pipe.attend(decode, state)


def test_cache_shapes(pipe, inputs):
    keys, values, prefill, _ = inputs
    with pytest.raises(ValueError, match=r"keys: expected shape \[B, Hkv, N, D\], got \(2, 300, 32\)"):
        pipe.prepare(keys[:, 0], values[:, 0])
    with pytest.raises(ValueError, match="keys and values differ in shape"):
        pipe.prepare(keys, values[:, :, :100])
    with pytest.raises(TypeError, match=r"keys: expected a floating dtype, got torch.int64"):
        pipe.prepare(keys.long(), values)
    with pytest.raises(TypeError, match=r"values: expected a torch.Tensor, got ndarray"):
        pipe.prepare(keys, values.numpy())


def test_cache_dtype_or_device_mismatch(pipe, inputs):
    keys, values, prefill, _ = inputs
    with pytest.raises(ValueError, match="must share dtype and device"):
        pipe.prepare(keys, values.half())
    with pytest.raises(ValueError, match="must share dtype and device"):
        pipe.prepare(keys, values.to("meta"))


def test_query_mismatches(pipe, inputs):
    keys, values, prefill, decode = inputs
    with pytest.raises(ValueError, match="queries: 5 query heads is not a multiple of 2 KV heads"):
        pipe.prepare(keys, values, prefill[:, :5])
    state = pipe.prepare(keys, values, prefill)
    with pytest.raises(ValueError, match=r"query: expected shape \[B, Hq, T, D\]"):
        pipe.attend(decode[0], state)
    with pytest.raises(ValueError, match="query: batch and head dim"):
        pipe.attend(decode[..., :16], state)
    with pytest.raises(ValueError, match="query: batch and head dim"):
        pipe.attend(decode[:1], state)
    with pytest.raises(
        ValueError,
        match=r"query: dtype/device torch.bfloat16/cpu differ from the cache's "
        "torch.float32/cpu",
    ):
        pipe.attend(decode.bfloat16(), state)
    with pytest.raises(ValueError, match=r"query: dtype/device .*meta"):
        pipe.attend(decode.to("meta"), state)


def test_empty_inputs(pipe, inputs):
    keys, values, prefill, decode = inputs
    with pytest.raises(ValueError, match=r"keys: an empty cache \(2, 2, 0, 32\) \(N = 0\)"):
        pipe.prepare(keys[:, :, :0], values[:, :, :0], prefill)
    with pytest.raises(ValueError, match=r"keys: an empty cache \(0, 2, 300, 32\) \(B = 0\)"):
        pipe.prepare(keys[:0], values[:0])
    with pytest.raises(ValueError, match=r"queries: no queries .* T = 0\); pass queries=None"):
        pipe.prepare(keys, values, prefill[:, :, :0])
    state = pipe.prepare(keys, values, prefill)
    with pytest.raises(ValueError, match=r"query: no queries in \(2, 6, 0, 32\)"):
        pipe.attend(decode[:, :, :0], state)
    state.append(keys[:, :, :0], values[:, :, :0])  # appending no rows is no growth, not an error
    assert state.num_tokens == keys.shape[2]


def test_decode_queries_keep_the_prefill_queries_head_count(pipe, inputs):
    keys, values, prefill, decode = inputs
    state = pipe.prepare(keys, values, prefill)
    more = torch.cat([decode, decode[:, :2]], dim=1)  # 8 heads: still a multiple of the 2 KV heads
    with pytest.raises(ValueError, match=r"query: 8 query heads, but the prefill queries prepare.. was given had 6"):
        pipe.attend(more, state)


def test_a_rank_beyond_the_head_dim_is_an_error(inputs):
    keys, values, prefill, _ = inputs  # head dim 32
    for spec, who in (
        ({"clusterer": {"name": "qgc", "num_clusters": 8, "rank": 33}}, "clusterer 'qgc'"),
        ({"selector": {"name": "qgs", "rank": 64}}, "selector 'qgs'"),
    ):
        with pytest.raises(
            ValueError, match=f"{who}: rank {33 if 'clusterer' in who else 64} is larger than the head dim 32"
        ):
            oa.build({**SPEC, **spec}).prepare(keys, values, prefill)
    oa.build({**SPEC, "selector": {"name": "qgs", "rank": 32}}).prepare(keys, values, prefill)  # the whole dim fits


def test_more_clusters_than_keys_to_cluster_reads_densely_and_says_why(inputs):
    keys, values, prefill, decode = inputs  # 300 tokens: 280 between sink and local window
    for clusters, dense in ((280, True), (279, False)):
        pipe = oa.build({**SPEC, "clusterer": {"name": "qgc", "num_clusters": clusters}})
        out, stats = pipe.attend(decode, pipe.prepare(keys, values, prefill), return_stats=True)
        assert stats.dense == dense
    assert stats.reason.startswith("sparse")
    pipe = oa.build({**SPEC, "clusterer": {"name": "kmeans", "num_clusters": 2000}})
    out, stats = pipe.attend(decode, pipe.prepare(keys, values, prefill), return_stats=True)
    assert stats.reason == (
        "dense: clusterer.num_clusters = 2000 >= the 280 keys between sink and local window of a "
        "300-token context (each key would be its own cluster)"
    )
    full = oa.build({**SPEC, "budget": {"density": 1.0}})
    assert torch.allclose(out, full.attend(decode, full.prepare(keys, values, prefill)), atol=1e-5)


def test_appended_rows_must_match_the_cache(pipe, inputs):
    keys, values, prefill, _ = inputs
    state = pipe.prepare(keys, values, prefill)
    with pytest.raises(ValueError, match=r"appended keys .* do not match the cache"):
        state.append(keys[:, :1, :2], values[:, :1, :2])


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf, "0.1"])
def test_invalid_scale(pipe, inputs, scale):
    keys, values, prefill, _ = inputs
    with pytest.raises(ValueError, match="scale: expected a positive finite number"):
        pipe.prepare(keys, values, prefill, scale=scale)


def test_state_from_another_pipeline(pipe, inputs):
    keys, values, prefill, decode = inputs
    state = oa.build(SPEC).prepare(keys, values, prefill)
    with pytest.raises(ValueError, match="state: pass the PipelineState this pipeline's prepare"):
        pipe.attend(decode, state)


def test_short_context_runs_dense_and_says_so():
    keys, values, prefill, decode = make_inputs(tokens=60)
    pipe = oa.build({**SPEC, "budget": {"tokens": 64}})
    out, stats = pipe.attend(decode, pipe.prepare(keys, values, prefill), return_stats=True)
    assert stats.dense and stats.reason == "dense: budget of 64 rows >= context of 60 tokens"
    assert stats.density == 1.0 and torch.isfinite(out).all()


def test_bad_masks(pipe, inputs):
    keys, values, prefill, _ = inputs
    with pytest.raises(ValueError, match=r"mask: expected a \[B, N\] = \[2, 300\] tensor, got \(2, 299\)"):
        pipe.prepare(keys, values, prefill, mask=torch.ones(2, 299, dtype=torch.bool))
    empty = torch.ones(2, 300, dtype=torch.bool)
    empty[1] = False
    with pytest.raises(ValueError, match="mask: every batch row needs at least one valid position"):
        pipe.prepare(keys, values, prefill, mask=empty)
    with pytest.raises(ValueError, match="mask: device meta differs from the cache's cpu"):
        pipe.prepare(keys, values, prefill, mask=torch.ones(2, 300, dtype=torch.bool, device="meta"))
    with pytest.raises(
        ValueError,
        match=r"mask: expected bool, or 0 \(padding\) and 1 \(valid\) values; got "
        "torch.float32 values such as 0.5",
    ):
        pipe.prepare(keys, values, prefill, mask=torch.full((2, 300), 0.5))
    ones = pipe.prepare(keys, values, prefill, mask=torch.ones(2, 300, dtype=torch.long))  # transformers' 0/1 masks
    assert ones.valid.dtype == torch.bool and bool(ones.valid.all())


def test_grow_to_a_cache_that_is_not_this_states(pipe, inputs):
    keys, values, prefill, _ = inputs
    state = pipe.prepare(keys[:, :, :-4], values[:, :, :-4], prefill)
    with pytest.raises(ValueError, match="grow_to: expected the grown cache"):
        state.grow_to(keys[:, :, :10], values[:, :, :10])
    with pytest.raises(CacheMismatch, match="first rows are not this state's"):
        state.grow_to(keys + 1, values)
    n = state.num_tokens
    middle = keys.clone()
    middle[1, 0, n // 2] += 1  # a row in the middle of the known ones, not the last
    with pytest.raises(CacheMismatch, match=f"compared at positions 0, {n // 3}, {n // 2}, {n - 1}"):
        state.grow_to(middle, values)
    bad = keys.clone()
    bad[0, 0, -1, 0] = float("nan")
    with pytest.raises(ValueError, match="appended keys: the cache contains NaN or Inf"):
        state.grow_to(bad, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_each_kind_of_bad_value_in_a_view(dtype):
    """The one-reduction finiteness check: NaN, +Inf and -Inf anywhere in a strided view of a larger cache (where
    the slots past the view hold NaN, which it must not read), and empty tensors."""
    from oa_core.contracts import all_finite

    cache = torch.full((2, 3, 40, 8), math.nan, dtype=dtype)
    cache[:, :, :25] = torch.randn(2, 3, 25, 8).to(dtype)
    view = cache[:, :, :25]
    assert bool(all_finite(view, view[:, :, :0]))
    for bad in (math.nan, math.inf, -math.inf):
        broken = view.clone()
        broken[1, 2, 24, 7] = bad
        assert not bool(all_finite(view, broken))
        assert not bool(all_finite(broken[:, :, 20:]))
    assert bool(all_finite(view[:, :, :0]))
