"""RULER's synthetic tasks generated offline (oa_core.eval.ruler): fitted to a token length with a real tokenizer
(SmolLM2's), answers where they belong, seeded, cached; RULER's scoring on hand-written cases."""

import re
from collections import Counter

import pytest

from oa_core.eval import ruler

LENGTH = 2048


@pytest.fixture(scope="module")
def samples(tokenizer, tmp_path_factory):
    cache = tmp_path_factory.mktemp("ruler-cache")
    return {task: ruler.generate(task, tokenizer, LENGTH, 2, seed=0, cache_dir=cache) for task in list(ruler.TASKS)}


def _count(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_prompts_fit_the_target_length(task, samples, tokenizer):
    for sample in samples[task]:
        tokens = _count(tokenizer, sample.prompt)
        assert tokens == sample.tokens
        assert LENGTH - 64 <= tokens <= LENGTH, (task, tokens)  # within one haystack unit below the target
        assert sample.question.endswith(ruler.TEMPLATES[ruler.TASKS[task].family][1].format(
            query=_query(sample), kind=ruler.TASKS[task].value, count=len(sample.answers)).lstrip())


def _query(sample):
    match = re.search(r"for (.+) mentioned in the provided text\?|assigned the value (\d+) in", sample.question)
    return next((g for g in match.groups() if g), "") if match else ""


def test_lengths_scale_with_the_target(tokenizer, tmp_path):
    for task in ("niah_single_2", "fwe"):
        sample = ruler.generate(task, tokenizer, 5000, 1, cache_dir=tmp_path)[0]
        assert 5000 - 64 <= _count(tokenizer, sample.prompt) <= 5000


@pytest.mark.parametrize("task", [t for t in list(ruler.TASKS) if t.startswith("niah")])
def test_needles_hold_the_answers(task, samples):
    config = ruler.TASKS[task]
    for sample in samples[task]:
        assert len(sample.answers) == config.values * config.queries
        keys = _query(sample).replace(" and ", ", ").split(", ")
        assert len(keys) == config.queries
        for key in keys:
            found = re.findall(rf"One of the special magic {config.value} for {re.escape(key)} is: ([\w-]+)\.",
                               sample.context)
            assert found and set(found) <= set(sample.answers)  # each asked key's needles, nothing else
        assert sorted(sum((re.findall(rf"for {re.escape(k)} is: ([\w-]+)\.", sample.context) for k in keys), [])) \
            == sorted(sample.answers)
        assert not any(answer in sample.question for answer in sample.answers)  # the question gives nothing away
        if config.haystack == "needle":  # a haystack of other keys' needles
            assert sample.context.count("One of the special magic") > 20


def test_variable_chain_is_complete_and_in_order(samples):
    for sample in samples["vt"]:
        value = _query(sample)
        chain = sample.answers
        assert len(chain) == ruler.VT_HOPS + 1
        positions = [sample.context.index(f"VAR {chain[0]} = {value}.")]
        positions += [sample.context.index(f"VAR {b} = VAR {a}.") for a, b in zip(chain, chain[1:])]
        assert positions == sorted(positions)


def test_common_words_are_the_most_common(samples):
    for sample in samples["cwe"]:
        listed = Counter(re.findall(r"^\d+\. (\w+)$", sample.context, flags=re.M))
        assert len(sample.answers) == ruler.CWE_COMMON
        assert all(listed[word] == ruler.CWE_COMMON_FREQ for word in sample.answers)
        assert max(n for word, n in listed.items() if word not in sample.answers) == ruler.CWE_RARE_FREQ


def test_frequent_words_are_the_most_frequent(samples):
    for sample in samples["fwe"]:
        body = sample.context.split("coded words. ", 1)[1]
        counts = Counter(w for w in body.split() if w != "....").most_common()
        assert [w for w, _ in counts[:ruler.FWE_ANSWERS]] == sample.answers
        assert counts[ruler.FWE_ANSWERS - 1][1] > counts[ruler.FWE_ANSWERS][1]  # no tie at the cut


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
    with pytest.raises(ValueError, match="unknown 'niah'.*niah_single_1"):
        ruler.generate("niah", tokenizer, LENGTH, 1)
    with pytest.raises(ValueError, match="length"):
        ruler.generate("vt", tokenizer, 100, 1)
    with pytest.raises(ValueError, match="count"):
        ruler.generate("vt", tokenizer, LENGTH, 0)
    with pytest.raises(ValueError, match="cwe: even the smallest prompt is longer than 512"):  # 300 listed words
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
    with pytest.raises(ValueError, match="unknown 'exact'.*string_match_all"):
        ruler.score("exact", "x", ["x"])


def test_a_tokenizer_without_a_chat_template_gets_plain_prompts(tokenizer, tmp_path):
    import copy

    base = copy.deepcopy(tokenizer)
    base.chat_template = None  # as a base model's GGUF tokenizer (Gemma-3-270M's) comes
    sample = ruler.generate("niah_single_2", base, LENGTH, 1, cache_dir=tmp_path)[0]
    assert sample.context.startswith("Some special magic numbers are hidden within the following text.")
    assert sample.question.startswith("\nWhat are all the special magic numbers for ")
    assert sample.question.endswith("mentioned in the provided text are")  # RULER's answer prefix, as it is
    assert "<|im_start|>" not in sample.context + sample.question
    assert ruler.tokenizer_key(base) != ruler.tokenizer_key(tokenizer)  # cached apart from the chat prompts
