"""RULER's synthetic tasks as NVIDIA/RULER generates them (at commit c3f5e3b), offline: seeded, fitted to a token
length with the model's tokenizer.

    samples = generate("niah_multikey_2", tokenizer, length=4096, count=20, seed=0)   # cached on disk
    sample.context, sample.question        # prefilled once (the haystack) / decoded by each method (setup B)
    score("string_match_all", output, sample.answers)

Tasks (RULER, Hsieh et al. 2024; qa_1/qa_2 need SQuAD/HotpotQA and are left out), with ``scripts/synthetic.yaml``'s
settings:
- ``niah_*``: needles "One of the special magic {numbers|uuids} for {key} is: {value}." in a haystack of the noise
  sentences (single_1), the essays (single_2/3, multikey_1, multivalue, multiquery) or other keys' needles
  (multikey_2/3); keys are adjective-noun pairs (wonderwords' lists) or UUIDs; with one value asked, the prompt is in
  the singular, as RULER rewrites it;
- ``vt``: variable tracking, a chain "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE ", ... (4 hops) among noise lines,
  after a worked example of about 500 tokens (3-letter names);
- ``cwe``: a list "1. word 2. word ..." in which 10 words appear 30 times and the rest 3 (6 and 1 below 4K), after a
  worked example of 40 words (20 below 4K);
- ``fwe``: coded 6-letter words with counts n·k⁻²/ζ(2) by rank k, the top rank being the noise '...'; the answers
  are ranks 2–4.

Every prompt, with the tokens RULER lets the model generate, fits the length: its haystack (words, sentences, needles,
list words, coded words) grows by bisection until one more unit would pass the target. Prompts use RULER's templates
and answer prefixes, wrapped in the tokenizer's chat template when it has one (the answer prefix then follows the
assistant turn's start; cwe's worked example is an earlier user and assistant turn); a base model's tokenizer has
none, and its prompt is the plain text after the special tokens it starts a text with (``offline_model.prompt_text``).
Where this differs from the official generator, and why: ``docs/evaluation.md``.

Scoring is RULER's: ``string_match_all`` (the fraction of references found in the output, case-insensitive, × 100)
and ``string_match_part`` (100 when any is found). Every task here uses ``string_match_all``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from oa_core.analysis.offline_model import cache_root, prompt_text
from oa_core.eval.ruler_tasks import (  # noqa: F401 (the API)
    BUILDERS,
    HARD_TASKS,
    NEW_TOKENS,
    TASKS,
    TEMPLATES,
    HaystackTooLarge,
    Prompt,
    check_dependencies,
    count_tokens,
    words_digest,
)

RULER_COMMIT = "c3f5e3b"  # NVIDIA/RULER, the generator followed here
GENERATOR = f"ruler-{RULER_COMMIT}"  # written in every record: a report never mixes generators unawares
REVISION = 1  # part of the cache key with GENERATOR: bump when the generated text changes for the same commit


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
    info: dict = field(default_factory=dict)  # e.g. where the needles went, as fractions of the haystack

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


METRICS: dict[str, Callable[[str, list[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def score(metric: str, output: str, answers: list[str]) -> float:
    if metric not in METRICS:
        raise ValueError(f"metric: unknown {metric!r}; known: {', '.join(METRICS)}")
    return METRICS[metric](output, answers)


# -- generation --------------------------------------------------------------------------------------------------


def generate(
    task: str,
    tokenizer,
    length: int,
    count: int,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> list[Sample]:
    """``count`` samples of ``task`` whose prompts, with the task's tokens to generate, fit ``length`` tokens of
    ``tokenizer`` (within one haystack unit); the same (task, length, tokenizer, seed) gives the same samples, from
    the cache after the first time (``cache_dir``, default ``$OA_CACHE_DIR`` or ``~/.cache/openattention``, under
    ``ruler/``)."""
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
    version = f"{GENERATOR}.{REVISION}-{words_digest()}"
    return root / "ruler" / f"{task}-{length}-{tokenizer_key(tokenizer)}-seed{seed}-{version}.jsonl"


def tokenizer_key(tokenizer) -> str:
    """A short digest of what the tokenizer does: its name (not the folder it was loaded from, so a cache carried to
    another machine still serves), vocabulary size, chat template and a probe's ids."""
    probe = "The special magic number for amber-river is: 1234567. VAR QXKZT = 88. ....\n1. word"
    parts = [
        Path(str(getattr(tokenizer, "name_or_path", ""))).name,
        str(len(tokenizer)),
        str(getattr(tokenizer, "chat_template", "")),
        str(tokenizer(probe, add_special_tokens=False).input_ids),
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:12]


def _read_cache(path: Path) -> list[Sample]:
    if not path.is_file():
        return []
    return [Sample(**json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _sample(task: str, tokenizer, length: int, seed: int, index: int) -> Sample:
    config = TASKS[task]
    rng = random.Random(f"ruler:{task}:{seed}:{index}")
    task_rng = random.Random(f"ruler:{task}:{seed}")  # what the official draws once for a whole set (vt's example)
    build, least = BUILDERS[config.family](config, rng, task_rng, tokenizer, length)
    chat = bool(getattr(tokenizer, "chat_template", None))
    budget = length - NEW_TOKENS[config.family]

    def render(size: int) -> tuple[str, str, Prompt]:
        prompt = build(size)
        history = [(user, answer.lstrip() if chat else answer) for user, answer in prompt.history]
        text = prompt_text(tokenizer, prompt.content, history)
        cut = text.rindex(prompt.question)  # setup B: the question is decoded
        return text[:cut], text[cut:] + (prompt.prefix.lstrip() if chat else prompt.prefix), prompt

    def fits(size: int) -> bool:
        try:
            context, question, _ = render(size)
        except HaystackTooLarge:
            return False
        return count_tokens(tokenizer, context + question) <= budget

    if not fits(least):
        raise ValueError(
            f"{task}: even the smallest prompt, with its {NEW_TOKENS[config.family]} tokens to generate, "
            f"is longer than {length} tokens"
        )
    low, high = least, 2 * least  # the largest haystack that fits: grow by doubling, then bisect
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    context, question, prompt = render(low)
    count = count_tokens(tokenizer, context + question)
    try:
        build(high)
    except HaystackTooLarge:  # the haystack stopped growing because its word list ran out, not at the target
        if count + NEW_TOKENS[config.family] < 0.9 * length:
            raise ValueError(
                f"{task}: its word list fills at most {count} prompt tokens, short of {length}; RULER "
                "draws past wonderwords' words from its english_words.json, which is not on the package "
                "index (docs/evaluation.md)"
            ) from None
    return Sample(
        task=task,
        index=index,
        context=context,
        question=question,
        answers=prompt.answers,
        tokens=count,
        max_new_tokens=NEW_TOKENS[config.family],
        info=dict(prompt.info),
    )
