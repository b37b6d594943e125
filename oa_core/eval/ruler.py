"""RULER's synthetic tasks, generated offline: seeded, fitted to a token length with the model's tokenizer.

    samples = generate("niah_multikey_2", tokenizer, length=4096, count=20, seed=0)   # cached on disk
    sample.context, sample.question        # prefilled once (the haystack) / decoded by each method (setup B)
    score("string_match_all", output, sample.answers)

Tasks (RULER, Hsieh et al. 2024; qa_1/qa_2 need SQuAD/HotpotQA and are left out):
- ``niah_single_1..3``: one needle "One of the special magic {numbers|uuids} for {key} is: {value}." in the noise
  haystack (1), in essays (2: numbers, 3: UUIDs);
- ``niah_multikey_1..3``: the needle among distractor needles of other keys — 3 in essays (1), a haystack made of
  needles (2: number values; 3: UUID keys and values);
- ``niah_multivalue``: four values for one key; ``niah_multiquery``: four keys asked at once;
- ``vt``: variable tracking — a chain "VAR A = 12345", "VAR B = VAR A", ... (4 hops) in noise; name every variable
  holding the value;
- ``cwe``: a numbered list of words, 10 of them 30 times each and the rest 3 times; name the 10 most common;
- ``fwe``: coded words drawn from a Zipf law (α = 2); name the 3 most frequent.

Prompts use RULER's templates and answer prefixes, wrapped in the tokenizer's chat template when it has one (the
answer prefix then follows the assistant turn's start); a base model's tokenizer has none, and its prompt is the
plain text after the special tokens it starts a text with (``offline_model.prompt_text``). A sample's token length
is that of the whole prompt (context + question + answer prefix); the haystack grows, by bisection on its size,
until the next step would pass the target. Each task's haystack unit — a sentence, a needle, a list word, a coded
word — is the step, so a prompt lands within that unit below the target (tested at 2K and 5K tokens: within 64).

Scoring is RULER's: ``string_match_all`` (the fraction of references found in the output, case-insensitive, × 100)
and ``string_match_part`` (100 when any is found). Every task here uses ``string_match_all``.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import random
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from oa_core.offline_model import cache_root, haystack_text, prompt_text

GENERATOR_VERSION = 2  # part of the cache key: bump when the generated text changes
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

TEMPLATES = {
    "niah": ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz "
             "you about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} "
             "mentioned in the provided text?",
             " The special magic {kind} for {query} mentioned in the provided text are"),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: Find all variables that are assigned the value {query} in the text above.",
           # RULER's answer prefix, its typo included: the prompt format is the benchmark's.
           " Answer: According to the chain(s) of variable assignment in the text above, {count} variables are "
           "assgined the value {query}, they are: "),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
            "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
            " Answer: The top 10 words that appear most often in the list are:"),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
            "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
            "What are the three most frequently appeared words in the above coded text?",
            " Answer: According to the coded text above, the three most frequently appeared words are:"),
}
NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}  # RULER's tokens_to_generate


@dataclass(frozen=True)
class TaskConfig:
    family: str  # niah, vt, cwe, fwe
    haystack: str = "essay"  # niah: noise, essay or needle
    key: str = "words"  # niah: words or uuids
    value: str = "numbers"  # niah: numbers or uuids
    keys: int = 1  # niah: needles of distinct keys (the first is asked; with needle haystacks, all are needles)
    values: int = 1  # niah: values per asked key
    queries: int = 1  # niah: keys asked


TASKS = {
    "niah_single_1": TaskConfig("niah", haystack="noise"),
    "niah_single_2": TaskConfig("niah"),
    "niah_single_3": TaskConfig("niah", value="uuids"),
    "niah_multikey_1": TaskConfig("niah", keys=4),
    "niah_multikey_2": TaskConfig("niah", haystack="needle"),
    "niah_multikey_3": TaskConfig("niah", haystack="needle", key="uuids", value="uuids"),
    "niah_multivalue": TaskConfig("niah", values=4),
    "niah_multiquery": TaskConfig("niah", queries=4),
    "vt": TaskConfig("vt"),
    "cwe": TaskConfig("cwe"),
    "fwe": TaskConfig("fwe"),
}
# The paper's "RULER HARD", without qa: where sparse methods lose most.
HARD_TASKS = ("vt", "cwe", "fwe", "niah_multikey_2", "niah_multikey_3", "niah_multivalue")

VT_HOPS, VT_CHAINS = 4, 1
CWE_COMMON, CWE_COMMON_FREQ, CWE_RARE_FREQ = 10, 30, 3
FWE_ALPHA, FWE_ANSWERS = 2.0, 3


@dataclass
class Sample:
    """One prompt, split where setup B splits it: ``context`` (prefilled once) and ``question`` (the rest: question,
    end of the user turn, assistant start, answer prefix). ``answers``: the references; ``tokens``: the whole
    prompt's length with the tokenizer it was fitted to; ``max_new_tokens``: RULER's generation length."""

    task: str
    index: int
    context: str
    question: str
    answers: list[str]
    tokens: int
    max_new_tokens: int
    metric: str = "string_match_all"
    info: dict = field(default_factory=dict)  # e.g. the needles' depths

    @property
    def prompt(self) -> str:
        return self.context + self.question


# -- scoring -----------------------------------------------------------------------------------------------------

def _clean(output: str) -> str:
    """RULER's post-processing of a prediction: control characters become newlines, ends stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", output.strip()).strip()


def string_match_all(output: str, answers: list[str]) -> float:
    """× 100 the fraction of ``answers`` found in ``output`` (case-insensitive)."""
    text = _clean(output).lower()
    return 100.0 * sum(answer.lower() in text for answer in answers) / len(answers)


def string_match_part(output: str, answers: list[str]) -> float:
    """100 when any of ``answers`` is found in ``output`` (case-insensitive), else 0."""
    text = _clean(output).lower()
    return 100.0 * any(answer.lower() in text for answer in answers)


METRICS: dict[str, Callable[[str, list[str]], float]] = {"string_match_all": string_match_all,
                                                         "string_match_part": string_match_part}


def score(metric: str, output: str, answers: list[str]) -> float:
    if metric not in METRICS:
        raise ValueError(f"metric: unknown {metric!r}; known: {', '.join(METRICS)}")
    return METRICS[metric](output, answers)


# -- generation --------------------------------------------------------------------------------------------------

def generate(task: str, tokenizer, length: int, count: int, seed: int = 0, cache_dir: str | os.PathLike | None = None,
             use_cache: bool = True) -> list[Sample]:
    """``count`` samples of ``task`` whose prompts are ``length`` tokens (within one haystack unit) with
    ``tokenizer``; the same (task, length, tokenizer, seed) gives the same samples, from the cache after the first
    time (``cache_dir``, default ``$OA_CACHE_DIR`` or ``~/.cache/openattention``, under ``ruler/``)."""
    if task not in TASKS:
        raise ValueError(f"task: unknown {task!r}; known: {', '.join(TASKS)}")
    if length < 256:
        raise ValueError(f"length: {length} tokens leaves no room for a haystack; use at least 256")
    if count < 1:
        raise ValueError(f"count: expected at least 1 sample, got {count}")
    path = cache_path(task, tokenizer, length, seed, cache_dir)
    cached = _read_cache(path) if use_cache else []
    if len(cached) >= count:
        return cached[:count]
    samples = cached + [_sample(task, tokenizer, length, seed, index) for index in range(len(cached), count)]
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # ranks generating at once never share a half-written file
        tmp.write_text("".join(json.dumps(asdict(s)) + "\n" for s in samples), encoding="utf-8")
        tmp.replace(path)  # never a half-written cache
    return samples


def cache_path(task: str, tokenizer, length: int, seed: int, cache_dir: str | os.PathLike | None = None) -> Path:
    root = Path(cache_dir) if cache_dir else cache_root()
    return root / "ruler" / f"{task}-{length}-{tokenizer_key(tokenizer)}-seed{seed}-v{GENERATOR_VERSION}.jsonl"


def tokenizer_key(tokenizer) -> str:
    """A short digest of what the tokenizer does: its name (not the folder it was loaded from, so a cache carried to
    another machine still serves), vocabulary size, chat template and a probe's ids."""
    probe = "The special magic number for amber-river is: 1234567. VAR QXKZT = 88. ....\n1. word"
    parts = [Path(str(getattr(tokenizer, "name_or_path", ""))).name, str(len(tokenizer)),
             str(getattr(tokenizer, "chat_template", "")), str(tokenizer(probe, add_special_tokens=False).input_ids)]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:12]


def _read_cache(path: Path) -> list[Sample]:
    if not path.is_file():
        return []
    return [Sample(**json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class _TooLarge(Exception):
    """A haystack size past what the task can fill (its word list)."""


def _sample(task: str, tokenizer, length: int, seed: int, index: int) -> Sample:
    config = TASKS[task]
    rng = random.Random(f"ruler:{task}:{seed}:{index}")
    build = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe}[config.family](config, rng)
    template, prefix = TEMPLATES[config.family]
    question_part = template.split("{context}")[1]
    chat = bool(getattr(tokenizer, "chat_template", None))

    def render(size: int) -> tuple[str, str, list[str], dict]:
        context, query, answers, fields = build(size)
        body = template.format(context=context, query=query, **fields)
        text = prompt_text(tokenizer, body)
        cut = text.rindex(question_part.format(query=query, **fields))  # setup B: the question is decoded
        answer_prefix = prefix.format(query=query, **fields)
        return text[:cut], text[cut:] + (answer_prefix.lstrip() if chat else answer_prefix), answers, fields

    def tokens(size: int) -> int:
        context, question, _, _ = render(size)
        return len(tokenizer(context + question, add_special_tokens=False).input_ids)

    def fits(size: int) -> bool:
        try:
            return tokens(size) <= length
        except _TooLarge:
            return False

    # The largest haystack that fits: grow by doubling, then bisect.
    if not fits(1):
        raise ValueError(f"{task}: even the smallest prompt is longer than {length} tokens")
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    context, question, answers, fields = render(low)
    count = len(tokenizer(context + question, add_special_tokens=False).input_ids)
    try:
        build(high)
    except _TooLarge:  # the haystack stopped growing because its word list ran out, not at the target
        if count < 0.9 * length:
            raise ValueError(f"{task}: its haystack fills at most {count} tokens, short of {length}") from None
    return Sample(task=task, index=index, context=context, question=question, answers=answers, tokens=count,
                  max_new_tokens=NEW_TOKENS[config.family], info=fields.get("info", {}))


# -- the tasks: each returns build(size) → (context, query, answers, template fields) -------------------------------

@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Words for keys and lists: the essays' lowercase words of 4–10 letters seen at least 3 times, sorted."""
    counts = Counter(re.findall(r"(?<![\w'])[a-z]{4,10}(?![\w'])", haystack_text()))
    return tuple(sorted(word for word, n in counts.items() if n >= 3))


@functools.lru_cache(maxsize=1)
def _essay_sentences() -> tuple[list[str], list[int]]:
    """The essays as sentences, with each one's character offset."""
    sentences = [s for s in re.split(r"(?<=[.!?]) ", re.sub(r"\s+", " ", haystack_text())) if s]
    offsets, position = [], 0
    for sentence in sentences:
        offsets.append(position)
        position += len(sentence) + 1
    return sentences, offsets


def _sentences(start: float, count: int) -> list[str]:
    """``count`` consecutive essay sentences from a fraction ``start`` of the essays (wrapping around)."""
    sentences, offsets = _essay_sentences()
    first = bisect.bisect_left(offsets, int(start * offsets[-1]))
    return [sentences[(first + i) % len(sentences)] for i in range(count)]


class _Stream:
    """An endless list drawn item by item from its own generator: the same prefix however far it was read."""

    def __init__(self, seed: float, draw: Callable[[random.Random], str]) -> None:
        self.rng, self.draw, self.items = random.Random(seed), draw, []

    def __getitem__(self, window: slice) -> list[str]:
        while len(self.items) < window.stop:
            self.items.append(self.draw(self.rng))
        return self.items[window]


def _uuid(rng: random.Random) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{'89ab'[int(h[16], 16) % 4]}{h[17:20]}-{h[20:]}"


def _niah(config: TaskConfig, rng: random.Random):
    words = vocabulary()
    kind = config.value

    def new_key(r: random.Random) -> str:
        return _uuid(r) if config.key == "uuids" else f"{r.choice(words)}-{r.choice(words)}"

    def new_value(r: random.Random) -> str:
        return _uuid(r) if config.value == "uuids" else str(r.randint(1_000_000, 9_999_999))

    keys: list[str] = []
    while len(keys) < max(config.keys, config.queries):
        key = new_key(rng)
        if key not in keys:
            keys.append(key)
    values = {key: [new_value(rng) for _ in range(config.values)] for key in keys}
    needles = [(key, value) for key in keys for value in values[key]]
    depths = [rng.random() for _ in needles]
    essay_start = rng.random()
    def distractor(r: random.Random) -> str:  # a needle of another key
        key = new_key(r)
        while key in values:
            key = new_key(r)
        return f"{key}\x00{new_value(r)}"

    distractors = _Stream(rng.random(), distractor)
    asked = keys[:config.queries]
    query = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
    answers = [value for key in asked for value in values[key]]

    def needle(key: str, value: str) -> str:
        return f"One of the special magic {kind} for {key} is: {value}."

    def build(size: int):
        if config.haystack == "needle":  # size: needles of other keys, one per line
            units, sep = [needle(*d.split("\x00")) for d in distractors[0:size]], "\n"
        elif config.haystack == "noise":  # size: repetitions of the noise sentences
            units, sep = [NOISE] * size, " "
        else:  # size: consecutive essay sentences
            units, sep = _sentences(essay_start, size), " "
        placed = list(units)
        for (key, value), depth in sorted(zip(needles, depths), key=lambda x: x[1], reverse=True):
            placed.insert(round(depth * len(units)), needle(key, value))
        return sep.join(placed), query, answers, {"kind": kind, "info": {"depths": [round(d, 3) for d in depths]}}

    return build


def _vt(config: TaskConfig, rng: random.Random):
    value = str(rng.randint(10_000, 99_999))
    chain: list[str] = []
    while len(chain) < VT_HOPS + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in chain:
            chain.append(name)
    statements = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
    depths = sorted(rng.random() for _ in statements)  # each assignment after the one it copies

    def build(size: int):  # size: repetitions of the noise sentences
        units = [NOISE] * size
        for statement, depth in sorted(zip(statements, depths), key=lambda x: x[1], reverse=True):
            units.insert(round(depth * size), statement)
        return " ".join(units), value, list(chain), {"count": len(chain),
                                                     "info": {"depths": [round(d, 3) for d in depths]}}

    return build


def _cwe(config: TaskConfig, rng: random.Random):
    words = list(vocabulary())
    rng.shuffle(words)
    common, rare_pool = words[:CWE_COMMON], words[CWE_COMMON:]
    shuffle_seed = rng.random()

    def build(size: int):  # size: rare words, each listed CWE_RARE_FREQ times
        if size > len(rare_pool):
            raise _TooLarge
        items = common * CWE_COMMON_FREQ + rare_pool[:size] * CWE_RARE_FREQ
        random.Random(shuffle_seed).shuffle(items)
        return "\n".join(f"{i + 1}. {word}" for i, word in enumerate(items)), "", list(common), {}

    return build


def _fwe(config: TaskConfig, rng: random.Random):
    vocab = list(dict.fromkeys("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
                               for _ in range(2000)))
    weights = [1 / (rank + 1) ** FWE_ALPHA for rank in range(len(vocab))]
    stream = _Stream(rng.random(), lambda r: r.choices(vocab, weights=weights)[0])

    def build(size: int):  # size: coded words, every tenth followed by '....'
        text = stream[0:size]
        counts = Counter(text).most_common()
        top = [word for word, _ in counts[:FWE_ANSWERS]]
        return " ".join(w + (" ...." if (i + 1) % 10 == 0 else "") for i, w in enumerate(text)), "", top, {}

    return build
