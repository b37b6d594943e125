"""RULER's synthetic tasks generated offline (oa_core.eval.ruler): fitted to a token length with a real tokenizer
(SmolLM2's), answers where they belong, seeded, cached; RULER's scoring on hand-written cases."""

import re

import pytest

from oa_core.eval import ruler, ruler_tasks

LENGTH = 2048


@pytest.fixture(scope="module")
def samples(tokenizer, tmp_path_factory):
    cache = tmp_path_factory.mktemp("ruler-cache")
    return {task: ruler.generate(task, tokenizer, LENGTH, 2, seed=0, cache_dir=cache) for task in list(ruler.TASKS)}


def _count(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_prompts_and_their_answers_fit_the_target_length(task, samples, tokenizer):
    room = ruler.NEW_TOKENS[ruler.TASKS[task].family]  # RULER counts the tokens to generate in the length
    for sample in samples[task]:
        tokens = _count(tokenizer, sample.prompt)
        assert tokens == sample.tokens and sample.max_new_tokens == room
        assert LENGTH - 64 <= tokens + room <= LENGTH, (task, tokens)  # within one haystack unit below the target
        assert all(answer not in sample.question for answer in sample.answers)  # the question gives nothing away


def test_lengths_scale_with_the_target(tokenizer, tmp_path):
    for task in ("niah_single_2", "fwe"):
        sample = ruler.generate(task, tokenizer, 5000, 1, cache_dir=tmp_path)[0]
        assert 5000 - 64 <= _count(tokenizer, sample.prompt) + sample.max_new_tokens <= 5000


def test_a_chat_template_wraps_the_prompt_and_cwes_example_is_an_earlier_turn(samples):
    sample = samples["cwe"][0]
    assert sample.context.startswith("<|im_start|>")
    assert sample.context.count("<|im_start|>user") == 2  # the worked example, then the task
    assert sample.context.count("<|im_start|>assistant\nAnswer: The top 10 words") == 1  # its answer, prefix first
    assert sample.question.endswith(
        "<|im_start|>assistant\nAnswer: The top 10 words that appear most often in the list are:"
    )  # RULER's answer prefix after the assistant turn's start
    vt = samples["vt"][0]
    assert vt.context.count("<|im_start|>user") == 1  # vt's example is inside the user turn, as RULER places it


def test_seeds_decide_the_samples(tokenizer, tmp_path):
    again = ruler.generate("niah_multikey_1", tokenizer, LENGTH, 2, seed=0, use_cache=False)
    other = ruler.generate("niah_multikey_1", tokenizer, LENGTH, 2, seed=1, use_cache=False)
    first = ruler.generate("niah_multikey_1", tokenizer, LENGTH, 2, seed=0, cache_dir=tmp_path)
    assert [s.prompt for s in again] == [s.prompt for s in first]
    assert all(a.prompt != b.prompt and a.answers != b.answers for a, b in zip(first, other))
    assert first[0].prompt != first[1].prompt  # samples of one seed differ too


def test_generated_sets_are_cached_by_task_length_tokenizer_and_seed(tokenizer, tmp_path, monkeypatch):
    made = ruler.generate("vt", tokenizer, LENGTH, 2, seed=3, cache_dir=tmp_path)
    path = ruler.cache_path("vt", tokenizer, LENGTH, 3, tmp_path)
    assert path.is_file() and str(LENGTH) in path.name and ruler.tokenizer_key(tokenizer) in path.name

    def no_generation(*args):
        raise AssertionError("generated again instead of read from the cache")

    monkeypatch.setattr(ruler, "_sample", no_generation)
    assert ruler.generate("vt", tokenizer, LENGTH, 2, seed=3, cache_dir=tmp_path) == made
    assert ruler.generate("vt", tokenizer, LENGTH, 1, seed=3, cache_dir=tmp_path) == made[:1]
    with pytest.raises(AssertionError, match="generated again"):  # another seed is not in the cache
        ruler.generate("vt", tokenizer, LENGTH, 1, seed=4, cache_dir=tmp_path)


def test_bad_arguments_are_named(tokenizer):
    with pytest.raises(ValueError, match=r"unknown 'niah'.*niah_single_1"):
        ruler.generate("niah", tokenizer, LENGTH, 1)
    with pytest.raises(ValueError, match="length"):
        ruler.generate("vt", tokenizer, 100, 1)
    with pytest.raises(ValueError, match="count"):
        ruler.generate("vt", tokenizer, LENGTH, 0)
    with pytest.raises(
        ValueError, match="cwe: even the smallest prompt, with its 120 tokens to generate, is longer than 512"
    ):  # its example and 10 words listed 6 times
        ruler.generate("cwe", tokenizer, 512, 1, use_cache=False)


def test_string_match_all_counts_the_references_found():
    assert ruler.string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 100.0
    assert ruler.string_match_all("The numbers are 1234567.", ["1234567", "7654321"]) == 50.0
    assert ruler.string_match_all("none here", ["1234567", "7654321", "1111111", "2222222"]) == 0.0
    assert ruler.string_match_all("  WALXU, egkrm\x00and more ", ["walxu", "EGKRM", "LAHRQ"]) == pytest.approx(200 / 3)
    assert ruler.string_match_all("12345678", ["1234567"]) == 100.0  # a substring match, as RULER's


def test_string_match_part_needs_any_reference():
    assert ruler.string_match_part("It is Paris.", ["paris", "Lyon"]) == 100.0
    assert ruler.string_match_part("It is Rome.", ["paris", "Lyon"]) == 0.0
    assert ruler.score("string_match_part", "LYON", ["paris", "lyon"]) == 100.0
    with pytest.raises(ValueError, match=r"unknown 'exact'.*string_match_all"):
        ruler.score("exact", "x", ["x"])


def test_a_tokenizer_without_a_chat_template_gets_plain_prompts(tokenizer, tmp_path):
    import copy

    base = copy.deepcopy(tokenizer)
    base.chat_template = None  # as a base model's GGUF tokenizer (Gemma-3-270M's) comes
    sample = ruler.generate("niah_multivalue", base, LENGTH, 1, cache_dir=tmp_path)[0]
    assert sample.context.startswith("Some special magic numbers are hidden within the following text.")
    assert sample.question.startswith("\nWhat are all the special magic numbers for ")
    assert sample.question.endswith("mentioned in the provided text are")  # RULER's answer prefix, as it is
    assert "<|im_start|>" not in sample.context + sample.question
    assert ruler.tokenizer_key(base) != ruler.tokenizer_key(tokenizer)  # cached apart from the chat prompts


def test_one_value_asked_is_asked_in_the_singular(samples):
    sample = samples["niah_single_3"][0]  # RULER rewrites its template when one value is asked
    assert "A special magic uuid is hidden within the following text." in sample.context
    assert re.search(r"\nWhat is the special magic uuid for .+ mentioned in the provided text\?", sample.question)
    assert sample.question.endswith(
        "The special magic uuid for "
        + sample.question.split(" for ")[1].split(" mentioned")[0]
        + " mentioned in the provided text is"
    )


def test_a_word_list_too_short_for_the_length_is_a_clear_error(tokenizer, monkeypatch):
    monkeypatch.setattr(ruler_tasks, "wonderwords_list", lambda kind: tuple(f"{kind[:4]}{i}" for i in range(20)))
    with pytest.raises(ValueError, match=r"cwe: its word list fills at most .* english_words.json"):
        ruler.generate("cwe", tokenizer, 8192, 1, use_cache=False)
