"""The fast decode path in transformers (oa_core.integration.static_cache): generate() through the static cache
against the default cache, eagerly and compiled (fullgraph, on the CPU), with a left-padded batch."""

import warnings

import pytest
import torch
from transformers import CompileConfig

import oa_core as oa
from test_integration import DENSE_BUDGET, SPARSE, prompt, tiny_llama


def generate(model, ids, mask, tokens, cache=None, **kwargs):
    if cache is not None:  # under the name the installed transformers gives it
        kwargs.update(oa.cache_kwargs(model, cache))
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.scores)


def padded_batch(length=300):
    ids = prompt(length, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    return ids, mask


def test_the_static_cache_decodes_like_the_default_cache():
    """The same prepared state, grown and attended on the device: the same logits at every step (to float rounding:
    the static path pads its rows to the width at capacity)."""
    model, (ids, mask) = tiny_llama(), padded_batch()
    with oa.patch(model, SPARSE) as handle:
        tokens, scores = generate(model, ids, mask, 6)
        cache = handle.static_cache(max_new_tokens=6)
        fast_tokens, fast_scores = generate(model, ids, mask, 6, cache=cache)
    torch.testing.assert_close(fast_scores, scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast_tokens, tokens)
    assert all(layer.state is not None for layer in cache.layers)  # every layer took the fast path
    assert not torch.equal(scores, generate(model, ids, mask, 6)[1])  # and it is sparse: not the model's own


def test_the_compiled_step_has_no_graph_break_and_the_same_logits():
    """What generate() does on a GPU, here with the aot_eager backend: one graph for the whole decode step
    (fullgraph=True raises at any break), the custom op inside it."""
    model, (ids, mask) = tiny_llama(), padded_batch()
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True  # generate compiles on accelerators only, unless asked
    with oa.patch(model, SPARSE) as handle:
        _, eager = generate(model, ids, mask, 5, cache=handle.static_cache(max_new_tokens=5))
        _, compiled = generate(model, ids, mask, 5, cache=handle.static_cache(max_new_tokens=5), compile_config=config)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_a_covering_budget_decodes_the_dense_tokens():
    model, (ids, mask) = tiny_llama(), padded_batch()
    dense_tokens, dense_scores = generate(model, ids, mask, 8)
    with oa.patch(model, DENSE_BUDGET) as handle:
        cache = handle.static_cache(max_new_tokens=8)
        tokens, scores = generate(model, ids, mask, 8, cache=cache)
        records = handle.stats.records
    assert torch.equal(tokens, dense_tokens)
    torch.testing.assert_close(scores, dense_scores, rtol=1e-5, atol=1e-5)
    assert all(layer.state is None and "budget covers its context" in layer.dense_reason for layer in cache.layers)
    assert all("budget covers its context" in r.reason for r in records if r.phase == "prefill")


def test_capacity_is_checked_before_a_step_overflows():
    model, (ids, mask) = tiny_llama(), padded_batch()
    with oa.patch(model, SPARSE) as handle:
        cache = handle.static_cache(max_new_tokens=3)
        with pytest.raises(ValueError, match=r"static cache: full at 303 slots .* max_new_tokens it was made for, 3"):
            generate(model, ids, mask, 6, cache=cache)
        with pytest.raises(ValueError, match=r"static cache: \d+ new tokens after its prompt; .* cache.reset\(\)"):
            generate(
                model, torch.cat([ids, ids[:, :50]], 1), torch.cat([mask, mask[:, :50]], 1), 1, cache=cache
            )  # generate continues a cache that holds tokens
        cache.reset()
        first, _ = generate(model, ids[:, 50:], mask[:, 50:], 3, cache=cache)  # a shorter prompt fits
        assert first.shape == (2, 3)
        cache.reset()
        with pytest.raises(ValueError, match="a prompt of 301 tokens and 3 new ones do not fit its capacity of 303"):
            generate(model, prompt(301, batch=2), torch.ones(2, 301, dtype=torch.long), 3, cache=cache)


def test_specs_the_fast_path_cannot_run_are_refused_up_front():
    model = tiny_llama()
    with (
        oa.patch(model, {**SPARSE, "selector": "quest"}) as handle,
        pytest.raises(
            ValueError, match="layer 0's spec cannot run on the fast path: selector 'quest' has no per-token codes"
        ),
    ):
        handle.static_cache(max_new_tokens=4)
    with (
        oa.patch(model, {**SPARSE, "tail": "sample"}) as handle,
        pytest.raises(ValueError, match="tail: sample draws a new sample at every step"),
    ):
        handle.static_cache(max_new_tokens=4)
    with oa.patch(model, SPARSE) as handle, pytest.raises(ValueError, match="max_new_tokens: expected a positive int"):
        handle.static_cache(max_new_tokens=0)


def test_a_one_token_prompt_and_what_the_stats_say():
    """A prompt of one token is a prompt (prefilled, then decoded), not a decode step: the default cache's tokens.
    After a sparse run the stats say what each static step reads, and that steps are not recorded one by one."""
    model = tiny_llama()
    one = prompt(1)
    with oa.patch(model, SPARSE) as handle:
        expected, _ = generate(model, one, torch.ones_like(one), 4)
        tokens, _ = generate(model, one, torch.ones_like(one), 4, cache=handle.static_cache(max_new_tokens=4))
    assert torch.equal(tokens, expected)
    ids, mask = padded_batch()
    with oa.patch(model, SPARSE) as handle:
        generate(model, ids, mask, 3, cache=handle.static_cache(max_new_tokens=3))
        stats = handle.stats
    sparse = stats.sparse()
    assert len(sparse) == 2 and all(0.19 < r.density < 0.3 for r in sparse)  # density 0.2 of each row's context
    assert "static cache: each decode step reads this budget" in stats.summary()
    assert "each component in turn" in stats.summary()  # the torch kernel has no fused step


def test_the_fast_path_warns_of_no_deprecated_name():
    """The static cache goes to ``generate`` under the name the installed transformers gives it
    (``oa.cache_kwargs``): no FutureWarning (transformers 5.24+ deprecates ``past_key_values``)."""
    model, (ids, mask) = tiny_llama(), padded_batch()
    with oa.patch(model, SPARSE) as handle, warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        tokens, _ = generate(model, ids, mask, 2, cache=handle.static_cache(max_new_tokens=2))
    assert tokens.shape == (2, 2)


def test_beam_search_is_refused_once_it_reorders_the_rows_and_runs_on_the_default_cache():
    model, ids = tiny_llama(), prompt(200)
    mask = torch.ones_like(ids)
    with oa.patch(model, SPARSE) as handle:
        beams, _ = generate(model, ids, mask, 6, num_beams=3)  # the default cache: the state follows the cache
        assert beams.shape == (1, 6)
        with pytest.raises(ValueError, match="beam search reorders the batch's rows"):
            generate(model, ids, mask, 6, cache=handle.static_cache(max_new_tokens=6), num_beams=3)
        layer = handle.static_cache(max_new_tokens=6).layers[0]
        layer.reorder_cache(torch.tensor([1, 0]))  # no state yet (before a prompt): nothing to follow


@pytest.mark.parametrize("padded", [False, True])
def test_transformers_own_static_cache_decodes_densely_and_says_why(padded):
    """Its empty slots reach the attention function as keys (with a mask that hides them, or none at an unpadded
    prompt): a patched model decodes densely on it, as the model does, and the stats name our static cache."""
    model = tiny_llama()
    ids, mask = padded_batch() if padded else (prompt(200), None)
    expected_tokens, expected = generate(model, ids, mask, 6, cache_implementation="static")
    with oa.patch(model, SPARSE) as handle:
        tokens, scores = generate(model, ids, mask, 6, cache_implementation="static")
        records = [r for r in handle.stats.records if r.phase != "prefill"]
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, expected_tokens)
    assert records and all(r.dense and r.reason == oa.integration.runtime.FOREIGN_STATIC for r in records)
