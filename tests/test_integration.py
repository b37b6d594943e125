"""OpenAttention inside transformers: a tiny random Llama built from a config (the offline model: slow tests)."""

import copy

import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

import oa_core as oa
from oa_core.analysis.offline_model import capture_attention
from oa_core.ops.geometry import QUERY_WINDOW

SPARSE = {"clusterer": {"name": "qgc", "num_clusters": 8}, "sink": 2, "local": 8, "budget": {"density": 0.2}}
DENSE_BUDGET = {**SPARSE, "budget": {"tokens": 100_000}}
# For tests that compare two routes through one pipeline, whichever it is: exact top-k's selection and the torch
# kernel, with no Triton program to interpret (PQS's and flash's took 20-30 s of each; the other tests here run the
# default through every route).
SPARSE_TORCH = {**SPARSE, "selector": {"name": "oracle"}, "kernel": "torch"}


def tiny_llama(seed=0, layers=2, dtype=torch.float32):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval().to(dtype)


def prompt(length, seed=1, batch=1):
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def continue_context(model, context, question, tokens):
    """``oa.generate_from_context`` as a user's own ``generate`` call on a copy of the context's cache: the layers'
    live states stay (``generate_from_context`` lets go of them when it returns)."""
    ids = torch.cat([context.input_ids, question], dim=1)
    mask = torch.cat([context.attention_mask, torch.ones_like(question)], dim=1)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
            **oa.integration.cache_kwargs(model, copy.deepcopy(context.cache)),
        )
    return out[:, ids.shape[1] :]


def greedy(model, ids, mask=None, tokens=12):
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask if mask is not None else torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_budget_covering_the_context_generates_exactly_like_sdpa(dtype):
    model, ids = tiny_llama(dtype=dtype), prompt(150)
    expected = greedy(model, ids)
    with oa.patch(model, DENSE_BUDGET) as handle:
        got = greedy(model, ids)
        stats = handle.stats
    assert torch.equal(got, expected)
    decode = [r for r in stats.records if r.phase == "decode"]
    assert decode and all(r.dense and r.reason == "dense: budget >= context" for r in decode)


def test_budget_covering_the_context_matches_eager_too():
    model, ids = tiny_llama(), prompt(120)
    model.set_attn_implementation("eager")
    expected = greedy(model, ids)
    with oa.patch(model, DENSE_BUDGET):
        assert torch.equal(greedy(model, ids), expected)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sparse_generation_reads_the_budget_and_reports_it(dtype):
    model, ids = tiny_llama(dtype=dtype), prompt(300)
    with oa.patch(model, SPARSE) as handle:
        out = greedy(model, ids, tokens=6)
    stats = handle.stats
    decode = [r for r in stats.records if r.phase == "decode"]
    assert out.shape == (1, 6) and len(decode) == 2 * 5  # 2 layers × 5 decode steps after the prefill
    assert all(not r.dense and 0.19 <= r.density <= 0.2 for r in decode)  # ⌊0.2·N⌋ rows of N
    assert all(r.proxies > 0 for r in decode) and stats.prepare_seconds > 0
    assert "prepare" in stats.summary() and set(stats.density_by_layer()) == {0, 1}


def test_logits_at_the_first_sparse_step_match_a_direct_attend():
    model, ids = tiny_llama(), prompt(201)
    context, step = ids[:, :200], ids[:, 200:]
    prefill_queries = {
        layer: q[:, :, -256:] for layer, (q, _, _, _) in capture_attention(model, context, [0, 1]).items()
    }
    pipe = oa.build(SPARSE)

    def direct(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if key.shape[2] == query.shape[2]:
            return AttentionInterface()["sdpa"](module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        past = key.shape[2] - query.shape[2]
        state = pipe.prepare(key[:, :, :past], value[:, :, :past], prefill_queries[module.layer_idx], scaling)
        state.append(key[:, :, past:], value[:, :, past:])
        return pipe.attend(query, state, causal=True).transpose(1, 2), None

    AttentionInterface.register("oa_test_direct", direct)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("oa_test_direct")
    with torch.no_grad():
        cache = oa.prefill_context(reference, context).cache
        expected = reference(step, use_cache=True, **oa.integration.cache_kwargs(reference, cache)).logits
        with oa.patch(model, SPARSE):
            cached = oa.prefill_context(model, context)
            got = model(step, use_cache=True, **oa.integration.cache_kwargs(model, copy.deepcopy(cached.cache))).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def snapshot(model):
    return (
        copy.deepcopy(model.config.to_dict()),
        model.config._attn_implementation,
        {k: v.clone() for k, v in model.state_dict().items()},
        [(name, sorted(vars(m))) for name, m in model.named_modules()],
    )


def test_patch_and_unpatch_leave_the_model_as_it_was():
    model, ids = tiny_llama(), prompt(120)
    before, expected = snapshot(model), greedy(model, ids)
    handle = oa.patch(model, SPARSE)
    assert model.config._attn_implementation == "openattention"
    greedy(model, ids)
    oa.unpatch(model)
    after = snapshot(model)
    assert after[0] == before[0] and after[1] == before[1] and after[3] == before[3]
    assert all(torch.equal(after[2][k], v) for k, v in before[2].items())
    assert torch.equal(greedy(model, ids), expected)
    handle.unpatch()  # a second unpatch is harmless


def test_two_models_with_different_specs_do_not_interfere():
    first, second, ids = tiny_llama(seed=0), tiny_llama(seed=1), prompt(200)
    with oa.patch(second, SPARSE):
        second_alone = greedy(second, ids)
    first_dense = greedy(first, ids)
    with oa.patch(first, DENSE_BUDGET) as a, oa.patch(second, SPARSE) as b:
        assert torch.equal(greedy(first, ids), first_dense)
        assert torch.equal(greedy(second, ids), second_alone)
        assert all(r.dense for r in a.stats.records) and any(not r.dense for r in b.stats.records)


def test_left_padded_batch_answers_like_each_prompt_alone():
    model = tiny_llama()
    prompts = [prompt(180, seed=3), prompt(260, seed=4)]
    with oa.patch(model, SPARSE):
        alone = [greedy(model, p) for p in prompts]
        ids = torch.zeros(2, 260, dtype=torch.long)
        mask = torch.zeros(2, 260, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, -p.shape[1] :], mask[row, -p.shape[1] :] = p[0], 1
        batched = greedy(model, ids, mask)
    for row in range(2):
        assert torch.equal(batched[row], alone[row][0])


def test_a_recorded_context_keeps_only_what_it_uses():
    """Each layer's recorded context holds its window of prefill queries and its [B, N] mask as tensors of their own,
    not views of the prefill's N queries or of the [B, 1, N, N] attention mask: memory kept for as long as the
    context is (several GB a process in ``oa eval``'s 8K batches)."""
    ids = prompt(600, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding: the layers see a 4D mask
    with oa.patch(tiny_llama(), SPARSE) as handle:
        oa.prefill_context(handle.model, ids, mask)
        for runtime in handle.runtimes.values():
            record = runtime.context
            assert record.queries.shape[2] == QUERY_WINDOW
            assert torch.equal(record.mask, mask.bool())
            for held in (record.queries, record.mask):
                assert held.untyped_storage().nbytes() == held.numel() * held.element_size()


@pytest.mark.parametrize("setup", ["A", "B"])
def test_context_prefilled_once_serves_every_question(setup):
    model, context, question = tiny_llama(), prompt(240, seed=5), prompt(20, seed=6)
    with oa.patch(model, SPARSE, setup=setup) as handle:
        ctx = oa.prefill_context(model, context)
        handle.reset_stats()
        first = oa.generate_from_context(model, ctx, question, max_new_tokens=5, pad_token_id=0)
        again = oa.generate_from_context(model, ctx, question, max_new_tokens=5, pad_token_id=0)
        records = handle.stats.records
    assert torch.equal(first, again)  # the context's cache and state are copied, never consumed
    # Each continuation's copy is let go when it returns (no layer's live state points into it any more).
    assert all(runtime.live is None for runtime in handle.runtimes.values())
    assert not any(r.phase == "prefill" for r in records)  # the context was not prefilled again
    question_calls = [r for r in records if r.phase == "question"]
    assert question_calls and all(r.dense == (setup == "A") for r in question_calls)
    # Whole prompt at once (dense prefill) vs context + question: setup A's only sparse parts are the decode steps.
    assert all(not r.dense for r in records if r.phase == "decode")


def test_switching_specs_keeps_only_the_current_pipelines_prepared_state():
    model, context, question = tiny_llama(), prompt(240, seed=5), prompt(20, seed=6)
    other = {**SPARSE, "budget": {"density": 0.1}}
    with oa.patch(model, SPARSE) as handle:
        ctx = oa.prefill_context(model, context)
        first = oa.generate_from_context(model, ctx, question, max_new_tokens=5, pad_token_id=0)
        runtimes = handle.runtimes.values()
        assert all(len(r.context.prepared) == 1 for r in runtimes)
        for spec in (other, SPARSE):  # a sweep: one spec after another on the same context
            handle.use(spec)
            assert all(not r.context.prepared for r in runtimes)  # the old pipelines' states are let go
            again = oa.generate_from_context(model, ctx, question, max_new_tokens=5, pad_token_id=0)
            assert all(len(r.context.prepared) == 1 for r in runtimes)
    assert torch.equal(first, again)  # prepared again from the recorded context, the same state


@pytest.mark.parametrize("setup", ["A", "B"])
def test_a_shared_question_answers_and_scores_as_the_whole_question_does(setup):
    """``share_question``: the question's leading blocks attended once, then generation and scoring each continue
    from a copy of the layers' states — the same tokens and log-likelihoods as from the context and the whole
    question, on a left-padded batch, with the shared tokens attended once instead of twice."""
    model = tiny_llama()
    ids, mask = prompt(240, seed=5, batch=2), torch.ones(2, 240, dtype=torch.long)
    ids[1, :40], mask[1, :40] = 0, 0
    question, answer = prompt(21, seed=6, batch=2), prompt(4, seed=8, batch=2)
    with oa.patch(model, SPARSE_TORCH, setup=setup) as handle:
        context = oa.prefill_context(model, ids, mask)
        handle.reset_stats()
        expected = (
            oa.generate_from_context(model, context, question, max_new_tokens=6, pad_token_id=0),
            oa.answer_logprob(model, context, question, answer),
        )
        alone = sum(r.tokens for r in handle.stats.records if r.phase == "question")
        handle.reset_stats()
        shared, rest = oa.share_question(model, context, question)
        got = (
            oa.generate_from_context(model, shared, rest, max_new_tokens=6, pad_token_id=0),
            oa.answer_logprob(model, shared, rest, answer),
        )
        together = sum(r.tokens for r in handle.stats.records if r.phase == "question")
        again = oa.answer_logprob(model, shared, rest, answer)  # the shared states are copied, never consumed
    # Setup B: whole causal blocks of the spec's local window (8), the rest more than one token; A: all but two.
    assert question.shape[1] - rest.shape[1] == {"A": 19, "B": 16}[setup]
    assert torch.equal(shared.input_ids, torch.cat([ids, question[:, : -rest.shape[1]]], dim=1))
    assert torch.equal(got[0], expected[0])
    assert torch.allclose(got[1], expected[1], atol=1e-5) and torch.equal(again, got[1])
    assert alone - together == (question.shape[1] - rest.shape[1]) * len(handle.runtimes)  # the shared part once
    assert all(runtime.live is None for runtime in handle.runtimes.values())


def test_a_shared_question_keeps_to_its_spec_and_whole_blocks_of_every_layer():
    model, context, question = tiny_llama(layers=3), prompt(240, seed=5), prompt(30, seed=6)
    with oa.patch(model, SPARSE, layer_specs={2: {**SPARSE, "local": 12}}) as handle:
        assert oa.integration.shared_question_tokens(model, 30) == 24  # whole blocks of 8 and of 12
        assert oa.integration.shared_question_tokens(model, 25) == 0  # 23 tokens hold no block of both
        ctx = oa.prefill_context(model, context)
        shared, rest = oa.share_question(model, ctx, question)
        assert rest.shape[1] == 6 and set(shared.states) == {0, 1, 2}
        handle.use({**SPARSE, "budget": {"density": 0.1}})
        with pytest.raises(ValueError, match=r"extended .* under another spec"):
            oa.generate_from_context(model, shared, rest, max_new_tokens=2, pad_token_id=0)
        with pytest.raises(ValueError, match=r"extend_context: expected tokens \[B=1, T >= 1\], got \(1, 0\)"):
            oa.extend_context(model, ctx, question[:, :0])
    with oa.patch(model, SPARSE, dense_layers=[0, 1, 2]):
        assert oa.integration.shared_question_tokens(model, 30) == 28  # no sparse layer: all but two


def test_answer_logprob_is_the_teacher_forced_likelihood():
    model, context, question, answer = tiny_llama(), prompt(100, seed=7), prompt(5, seed=8), prompt(4, seed=9)
    with oa.patch(model, DENSE_BUDGET):
        got = oa.answer_logprob(model, oa.prefill_context(model, context), question, answer)
    ids = torch.cat([context, question, answer], dim=1)
    with torch.no_grad():
        logits = model(ids).logits[:, -5:-1].log_softmax(-1)
    assert torch.allclose(got, logits.gather(-1, answer[..., None]).sum((1, 2)), atol=1e-4)


def test_dense_layers_and_layer_specs():
    model, ids = tiny_llama(layers=3), prompt(300)
    with oa.patch(model, SPARSE, dense_layers=[0], layer_specs={2: {**SPARSE, "budget": {"density": 0.5}}}) as h:
        greedy(model, ids, tokens=3)
    density = {
        layer: [r.density for r in h.stats.records if r.layer == layer and r.phase == "decode"] for layer in range(3)
    }
    assert all(d == 1.0 for d in density[0])
    assert all(0.19 <= d <= 0.2 for d in density[1]) and all(0.49 <= d <= 0.5 for d in density[2])
    with pytest.raises(oa.SpecError, match="layers: layer 7 does not exist"):
        oa.patch(model, SPARSE, dense_layers=[7])
    with pytest.raises(oa.SpecError, match="setup: expected 'A'"):
        oa.patch(model, SPARSE, setup="C")


def test_attn_implementation_route_uses_the_config_spec():
    """``attn_implementation="openattention"`` with ``config.openattention`` computes what ``oa.patch`` with that spec
    computes: the same greedy tokens, and the same (sparse, setup B) answer log-likelihood after a recorded context,
    which differs from dense."""
    model, ids = tiny_llama(), prompt(300)
    context_ids, question, answer = ids[:, :260], ids[:, 260:290], ids[:, 290:]

    def generation_and_logprob():
        tokens = greedy(model, ids)
        return tokens, oa.answer_logprob(model, oa.prefill_context(model, context_ids), question, answer)

    dense_logprob = oa.answer_logprob(model, oa.prefill_context(model, context_ids), question, answer)
    with oa.patch(model, SPARSE_TORCH):
        expected_tokens, expected_logprob = generation_and_logprob()
    oa.integration.register()
    model.config.openattention = SPARSE_TORCH
    model.set_attn_implementation("openattention")
    tokens, logprob = generation_and_logprob()
    assert torch.equal(tokens, expected_tokens)
    assert torch.equal(logprob, expected_logprob)
    assert (logprob - dense_logprob).abs().max() > 1e-3, (logprob, dense_logprob)  # it can tell sparse from dense
    runtimes = list(oa.integration.runtimes(model).values())
    assert len(runtimes) == 2 and all(r.pipeline.spec.budget.density == 0.2 for r in runtimes)
    assert any(not r.dense for rt in runtimes for r in rt.records)


@pytest.mark.slow
def test_offline_model_with_a_covering_budget_generates_like_sdpa():
    from oa_core.analysis.needle import make_samples
    from oa_core.analysis.offline_model import load_offline_model

    model, tokenizer = load_offline_model()
    sample = make_samples(tokenizer, 1, 600, seed=3)[0]
    ids = torch.cat([sample.context_ids, sample.question_ids], dim=1)
    expected = greedy(model, ids, tokens=10)
    with oa.patch(model, {"budget": {"tokens": 100_000}}):
        assert torch.equal(greedy(model, ids, tokens=10), expected)
        context = oa.prefill_context(model, sample.context_ids)
        again = oa.generate_from_context(
            model, context, sample.question_ids, max_new_tokens=10, pad_token_id=tokenizer.eos_token_id
        )
    assert torch.equal(again, expected)


def test_a_cache_prefilled_before_patching_is_prepared_on_first_use():
    model = tiny_llama()
    prompts = [prompt(150, seed=10), prompt(220, seed=11)]
    ids = torch.zeros(2, 220, dtype=torch.long)
    mask = torch.zeros(2, 220, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, -p.shape[1] :], mask[row, -p.shape[1] :] = p[0], 1
    context = oa.prefill_context(model, ids, mask)  # unpatched: no runtime saw it
    with oa.patch(model, SPARSE) as handle:
        out = continue_context(model, context, prompt(3, seed=12).expand(2, 3), tokens=4)
        first = [r for r in handle.stats.records if r.phase == "question"]
    assert out.shape == (2, 4) and first and all(not r.dense for r in first)
    # Each row's budget comes from its own length: the padding was recognised from the attention mask.
    state = handle.runtimes[0].live
    assert state.valid.sum(-1).tolist() == [150 + 3 + 3, 220 + 3 + 3]


def test_a_cache_of_the_live_states_length_but_other_rows_is_not_continued():
    """After a generation the live state holds N rows; another cache of N rows must be prepared afresh, not taken
    for the live state's continuation (its rows decide, not its length)."""
    model, question = tiny_llama(), prompt(3, seed=22)
    other = oa.prefill_context(model, prompt(206, seed=21))  # unpatched: no runtime saw it
    with oa.patch(model, SPARSE) as handle:
        alone = oa.generate_from_context(model, other, question, max_new_tokens=4, pad_token_id=0)
    with oa.patch(model, SPARSE) as handle:
        first = oa.prefill_context(model, prompt(200, seed=20))
        continue_context(model, first, question, tokens=4)
        assert handle.runtimes[0].live.num_tokens == 206 == other.cache.get_seq_length()
        after = oa.generate_from_context(model, other, question, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(after, alone)


def test_patching_a_model_without_attention_layers_is_refused():
    with pytest.raises(TypeError, match="Linear: no causal self-attention layers found"):
        oa.patch(torch.nn.Linear(2, 2))


def test_an_encoders_attention_on_the_route_is_sdpa_and_gets_no_runtime():
    from transformers import SiglipVisionConfig
    from transformers.models.siglip.modeling_siglip import SiglipAttention

    module = SiglipAttention(SiglipVisionConfig(hidden_size=32, num_attention_heads=2))  # a vision tower's
    query, key, value = torch.randn(3, 1, 2, 10, 16).unbind(0)
    out, _ = oa.integration.runtime.openattention_attention(module, query, key, value, None, scaling=module.scale)
    expected, _ = oa.integration.prefill.model_sdpa(module, query, key, value, None, module.scale, 0.0)
    assert torch.equal(out, expected) and module not in oa.integration.runtime._RUNTIMES


def test_an_invalid_spec_leaves_the_model_unpatched():
    model = tiny_llama()
    with pytest.raises(oa.SpecError, match=r"budget.density"):
        oa.patch(model, {"budget": {"density": 2}})
    assert model.config._attn_implementation == "sdpa"
    assert oa.integration.runtimes(model) == {}


def test_spelled_out_causal_mask_is_sdpas_own_causal_prefill():
    """The mask ``_sdpa`` gives an unpadded float32 prefill of grouped heads on CUDA: transformers' sdpa with it (the
    heads repeated) is sdpa without it (the groups passed as they are, ``is_causal``)."""
    layer = tiny_llama().model.layers[0].self_attn
    gen = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(2, heads, 40, 16, generator=gen) for heads in (6, 2, 2))
    sdpa = AttentionInterface()["sdpa"]
    expected, _ = sdpa(layer, query, key, value, None, scaling=0.25)
    got, _ = sdpa(layer, query, key, value, oa.integration.prefill.causal_mask(40, "cpu"), scaling=0.25)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    shifted, _ = sdpa(
        layer, query, key, value, oa.integration.prefill.causal_mask(40, "cpu").transpose(-1, -2), scaling=0.25
    )
    assert not torch.allclose(shifted, expected, atol=1e-3)  # the mask's orientation matters: the check could fail


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the math-kernel fallback is CUDA's")
def test_grouped_float32_prefill_on_cuda_does_not_materialise_the_scores():
    """An unpadded float32 8K prefill of 9 query heads over 3 KV heads through ``_sdpa``: its scores alone would be
    9 × 8192² × 4 B = 2.25 GiB; the memory-efficient kernel needs a fraction of that."""
    layer = tiny_llama().model.layers[0].self_attn
    query, key, value = (torch.randn(1, heads, 8192, 64, device="cuda") for heads in (9, 3, 3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, _ = oa.integration.prefill.model_sdpa(layer, query, key, value, None, None, 0.0)
    assert (torch.cuda.max_memory_allocated() - before) / 2**30 < 1.0
    assert out.shape == (1, 8192, 9, 64)


def test_prefill_memory_benchmark_without_cuda_says_it_needs_a_gpu(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "studies" / "prefill_memory.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        timeout=120,
    )
    assert done.returncode != 0 and "prefill_memory: needs a CUDA GPU" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_short_context_whose_budget_cannot_cover_sink_and_local_runs_dense_and_says_why():
    # 3% of 200 tokens is 6 rows, fewer than the default sink + local of 4 + 64: dense, exactly sdpa, with the reason.
    model, ids = tiny_llama(), prompt(200)
    expected = greedy(model, ids, tokens=4)
    with oa.patch(model, {"budget": {"density": 0.03}}) as handle:
        got = greedy(model, ids, tokens=4)
        stats = handle.stats
    assert torch.equal(got, expected)
    decode = [r for r in stats.records if r.phase == "decode"]
    assert decode and all(
        r.dense and r.reason == "dense: budget of 6 rows (3.0% of 200 tokens) < sink + local = 68" for r in decode
    )
