"""The RULER generator against the official one: each task's seeded samples, prompted as RULER's ``base`` model
template prompts them (plain text), checked against what ``fixtures/ruler_c3f5e3b.json`` transcribes from
NVIDIA/RULER's files at that commit — the task's settings, its template and answer prefix, its separators, its counts
and its answer set. The fixture is read from RULER's code, not from ``oa_core.eval.ruler``."""

import copy
import itertools
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from oa_core.eval import ruler, ruler_tasks

OFFICIAL = json.loads((Path(__file__).parent / "fixtures" / "ruler_c3f5e3b.json").read_text(encoding="utf-8"))
TASKS = [task for task in OFFICIAL["tasks"] if not task.startswith("_")]
LENGTHS = (2048, 4096)  # cwe changes its example and counts at 4096


@pytest.fixture(scope="module")
def plain(tokenizer):
    """The tokenizer without its chat template: prompts are then the text RULER's ``base`` template makes."""
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    return base


@pytest.fixture(scope="module")
def samples(plain, tmp_path_factory):
    cache = tmp_path_factory.mktemp("ruler-fidelity")
    return {
        (task, length): ruler.generate(task, plain, length, 2, seed=0, cache_dir=cache)
        for task in TASKS
        for length in LENGTHS
    }


def test_the_generator_names_the_commit_it_follows():
    assert f"ruler-{OFFICIAL['commit']}" == ruler.GENERATOR


@pytest.mark.parametrize("task", TASKS)
def test_each_task_has_rulers_settings(task):
    official = OFFICIAL["tasks"][task]
    config = ruler.TASKS[task]
    assert config.family == official["family"]
    assert {name: getattr(config, name) for name in official["args"]} == official["args"]


def test_templates_answer_prefixes_and_generation_lengths_are_rulers():
    for family, official in OFFICIAL["templates"].items():
        if family.startswith("_"):
            continue
        assert ruler.TEMPLATES[family] == (official["template"], official["answer_prefix"])
        assert ruler.NEW_TOKENS[family] == official["tokens_to_generate"]


def test_needle_depths_are_rulers():
    np = pytest.importorskip("numpy")
    assert list(ruler_tasks.DEPTHS) == np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int).tolist()


def _template(family: str, singular: bool = False) -> tuple[str, str]:
    official = OFFICIAL["templates"][family]
    template, prefix = official["template"], official["answer_prefix"]
    for plural, one in OFFICIAL["niah"]["singular_replacements"] if singular else ():
        template, prefix = template.replace(plural, one), prefix.replace(plural, one)
    return template, prefix


def _regex(text: str, tag: str = "") -> str:
    """A template as a regex: each placeholder a named group (its name + ``tag``) the first time, the same value
    after."""
    seen: set[str] = set()

    def group(match: re.Match) -> str:
        name = match.group(1) + tag
        if name in seen:
            return f"(?P={name})"
        seen.add(name)
        return f"(?P<{name}>.*)" if name.startswith("context") else f"(?P<{name}>.+?)"

    return re.sub(r"\\\{(\w+)\\\}", group, re.escape(text))


def _fields(prompt: str, family: str, singular: bool = False, before: str = "") -> dict:
    """The placeholders' values of a prompt that is ``before`` (a regex) then the template and its answer prefix."""
    template, prefix = _template(family, singular)
    match = re.fullmatch(before + _regex(template + prefix), prompt, flags=re.S)
    assert match, f"not RULER's {family} template: {prompt[:200]!r} ... {prompt[-200:]!r}"
    return match.groupdict()


def _fits(sample, plain, length):
    tokens = len(plain(sample.prompt, add_special_tokens=False).input_ids)
    assert tokens == sample.tokens
    assert tokens + OFFICIAL["templates"][ruler.TASKS[sample.task].family]["tokens_to_generate"] <= length


@pytest.mark.parametrize("task", [t for t in TASKS if OFFICIAL["tasks"][t]["family"] == "niah"])
def test_niah_prompts_are_rulers(task, samples, plain):
    args, niah = OFFICIAL["tasks"][task]["args"], OFFICIAL["niah"]
    singular = args["num_needle_q"] * args["num_needle_v"] == 1
    kind = args["type_needle_v"][:-1] if singular else args["type_needle_v"]
    value = rf"\d{{{niah['numbers_digits']:d}}}" if args["type_needle_v"] == "numbers" else _UUID
    needle = (
        _regex(niah["needle"])
        .replace("(?P<type_needle_v>.+?)", args["type_needle_v"])
        .replace("(?P<key>.+?)", "(?P<key>.+?)")
        .replace("(?P<value>.+?)", f"(?P<value>{value})")
    )
    for length in LENGTHS:
        for sample in samples[task, length]:
            _fits(sample, plain, length)
            fields = _fields(sample.prompt, "niah", singular)
            assert fields["type_needle_v"] == kind
            joins = niah["query_join"]
            queries = (
                [*fields["query"].split(joins[1])[0].split(joins[0]), fields["query"].split(joins[1])[1]]
                if args["num_needle_q"] > 1
                else [fields["query"]]
            )
            assert len(queries) == args["num_needle_q"]
            context = fields["context"]
            needles = [(m.group("key"), m.group("value")) for m in re.finditer(needle, context)]
            if args["type_haystack"] == "needle":
                lines = context.split(niah["list_separator"])
                assert all(re.fullmatch(needle, line) for line in lines)  # a haystack of needles, one a line
            else:
                assert len(needles) == max(args["num_needle_k"], args["num_needle_q"]) * args["num_needle_v"]
            ours = [(k, v) for k, v in needles if k in queries]
            assert len(ours) == args["num_needle_q"] * args["num_needle_v"]
            assert sorted(v for _, v in ours) == sorted(sample.answers)  # the asked keys' values, nothing else
            assert all(_is_key(key, args["type_needle_k"]) for key, _ in needles)
            if args["type_haystack"] == "noise":
                lines = context.split(niah["list_separator"])
                assert all(line == niah["noise"] or re.fullmatch(needle, line) for line in lines)
                assert len(lines) > 50
            if args["type_haystack"] == "essay":
                _check_essay(context, [m.group(0) for m in re.finditer(needle, context)])


_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


def _is_key(key: str, kind: str) -> bool:
    if kind == "uuids":
        return re.fullmatch(_UUID, key) is not None
    adjectives, nouns = (set(ruler_tasks.wonderwords_list(kind)) for kind in ("adjectivelist", "nounlist"))
    return any(key[:i] in adjectives and key[i + 1 :] in nouns for i, c in enumerate(key) if c == "-")


def _check_essay(context: str, needles: list[str]):
    """The essays from their first word, whole sentences between the needles, each needle after sentence
    int(sentences × depth / 100) for one of RULER's depths."""
    pieces = re.split("|".join(map(re.escape, needles)), context)
    segments = [piece.strip() for piece in pieces]
    haystack = " ".join(s for s in segments if s)
    squeezed = "".join(haystack.split())  # the sentences are joined by a space, as RULER joins them: compare the rest
    assert squeezed == "".join(ruler_tasks.essay_words())[: len(squeezed)]
    splitter = ruler_tasks.sentence_splitter()
    sentences = splitter.tokenize(haystack)
    before = 0
    for segment in segments[:-1]:
        before += len(splitter.tokenize(segment)) if segment else 0
        assert any(before == int(len(sentences) * depth / 100) for depth in ruler_tasks.DEPTHS), before


def test_vt_prompts_are_rulers(samples, plain):
    vt, args = OFFICIAL["vt"], OFFICIAL["tasks"]["vt"]["args"]
    for length in LENGTHS:
        for sample in samples["vt", length]:
            _fits(sample, plain, length)
            template, prefix = _template("vt")
            example = f"(?P<example>{_regex(template + prefix, '_shown')}) (?P<names>[A-Z ]+)\n\n"
            match = re.fullmatch(example + _regex(template + prefix), sample.prompt, flags=re.S)
            assert match, sample.prompt[:300]
            shown = match.group("example")
            example_names = match.group("names").split(" ")
            _check_chain(
                shown[len(template.split("{context}")[0]) : shown.index("\nQuestion:")],
                example_names,
                vt["example_name_letters"],
                args["num_hops"],
            )
            # The example fills RULER's 500 tokens (without a model's template) to within a noise line.
            tokens = len(plain(shown, add_special_tokens=False).input_ids)
            noise_line = len(plain(OFFICIAL["niah"]["noise"] + "\n", add_special_tokens=False).input_ids)
            assert abs(tokens - vt["example_tokens"]) < noise_line  # fitted before its names and value are drawn
            fields = _fields(sample.prompt, "vt", before=re.escape(shown) + r" [A-Z ]+\n\n")
            assert fields["num_v"] == str(args["num_hops"] + 1)
            assert vt["value_range"][0] <= int(fields["query"]) <= vt["value_range"][1]
            _check_chain(fields["context"], sample.answers, vt["name_letters"], args["num_hops"], fields["query"])


def _check_chain(context: str, names: list[str], letters: int, hops: int, value: str | None = None):
    """Noise lines and the chain's statements, one a line, in chain order, as RULER writes them."""
    lines = context.split(OFFICIAL["vt"]["line_separator"])
    statements = [line for line in lines if line != OFFICIAL["niah"]["noise"]]
    assert len(names) == hops + 1 == len(set(names))
    assert all(re.fullmatch(f"[A-Z]{{{letters}}}", name) for name in names)
    first = OFFICIAL["vt"]["first"].format(name=names[0], value=value or r"\d{5}")
    assert re.fullmatch(first, statements[0]) if value is None else statements[0] == first
    hop = OFFICIAL["vt"]["hop"]
    assert statements[1:] == [hop.format(name=b, previous=a) for a, b in itertools.pairwise(names)]


def _numbered(text: str) -> list[str]:
    """RULER's "1. w 2. w ..." list, its numbers checked to run from 1 without a gap."""
    items, number = [], 1
    assert text.startswith("1. ")
    rest = text[3:]
    while True:
        marker = f" {number + 1}. "
        if marker not in rest:
            items.append(rest)
            return items
        item, rest = rest.split(marker, 1)
        items.append(item)
        number += 1


def test_cwe_prompts_are_rulers(samples, plain):
    cwe, args = OFFICIAL["cwe"], OFFICIAL["tasks"]["cwe"]["args"]
    words = set(
        ruler_tasks.wonderwords_list("nounlist")
        + ruler_tasks.wonderwords_list("adjectivelist")
        + ruler_tasks.wonderwords_list("verblist")
    )
    template, prefix = _template("cwe")
    for length in LENGTHS:
        below = length < cwe["below"]
        example = cwe["example_below"] if below else cwe["example"]
        common, other = (
            (cwe["task_below"]["common"], cwe["task_below"]["other"]) if below else (args["freq_cw"], args["freq_ucw"])
        )
        for sample in samples["cwe", length]:
            _fits(sample, plain, length)
            shot = f"(?P<example>{_regex(template + prefix, '_shown')}) (?P<shown>1\\. .*?)\n"
            match = re.fullmatch(shot + _regex(template + prefix), sample.prompt, flags=re.S)
            assert match, sample.prompt[:300]
            shown = Counter(_numbered(re.search(r"\n(1\. .*)\nQuestion", match.group("example"), re.S).group(1)))
            assert len(shown) == example["words"]
            assert sorted(Counter(shown.values()).items()) == sorted(
                {example["common"]: args["num_cw"], example["other"]: example["words"] - args["num_cw"]}.items()
            )
            assert set(_numbered(match.group("shown"))) == {w for w, n in shown.items() if n == example["common"]}
            listed = Counter(_numbered(match.group("context")))
            assert set(listed) <= words
            assert {n for w, n in listed.items() if w not in sample.answers} == {other}
            assert [listed[w] for w in sample.answers] == [common] * args["num_cw"]


def test_fwe_prompts_are_rulers(samples, plain):
    zeta = pytest.importorskip("scipy.special").zeta  # what RULER calls
    fwe, alpha = OFFICIAL["fwe"], OFFICIAL["tasks"]["fwe"]["args"]["alpha"]
    for length in LENGTHS:
        for sample in samples["fwe", length]:
            _fits(sample, plain, length)
            coded = _fields(sample.prompt, "fwe")["context"].split(fwe["separator"])
            counts = Counter(coded).most_common()
            assert counts[0][0] == fwe["noise_word"]
            assert [w for w, _ in counts[1:4]] == sample.answers  # ranks 2–4
            assert all(re.fullmatch(f"[a-z]{{{fwe['coded_wordlen']}}}", w) for w, _ in counts[1:])
            assert len(counts) <= (length - OFFICIAL["templates"]["fwe"]["tokens_to_generate"]) // 50
            # Every count is int(n · k^-α / ζ(α)) of its rank k, for one n.
            first = counts[0][1]
            n_range = range(int(first * zeta(alpha)), int((first + 1) * zeta(alpha)) + 2)
            law = [[int(n * k**-alpha / zeta(alpha)) for k in range(1, len(counts) + 1)] for n in n_range]
            assert [c for _, c in counts] in law
