"""Needle in a haystack on a real model: dense attention against OpenAttention on one prefilled context.

A seeded sample hides "The special magic {number|word|uuid} for <key> is: <value>." at a random depth of a haystack
text fitted to a token length (RULER's niah wording; the essays by default, or another of ``offline_model.TEXTS``),
asks for it through the model's chat template (plain text for a base model: ``offline_model.prompt_text``), and
splits the prompt into the *context* (prefilled once, densely) and the *question* (decoded with each spec: setup B).
Each spec answers greedily from its own copy of the context's cache; the teacher-forced log-likelihood of the true
answer is measured the same way. Values: 7 digits (``number``), two words joined by a hyphen (``word``), a version-4
UUID (``uuid``: a long code, where a selection that loses rows gets the last characters wrong).
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from tqdm import tqdm

import oa_core as oa
from oa_core.analysis.offline_model import haystack_text, prompt_text

WORDS = (
    "amber",
    "breeze",
    "candle",
    "dune",
    "ember",
    "falcon",
    "glacier",
    "harbor",
    "ivory",
    "juniper",
    "kettle",
    "lantern",
    "meadow",
    "nectar",
    "orchid",
    "pebble",
    "quartz",
    "river",
    "saffron",
    "timber",
    "umbra",
    "velvet",
    "willow",
    "zephyr",
)
INSTRUCTION = (
    "Some special magic {kinds} are hidden within the following text. Make sure to memorize it. I will "
    "quiz you about the {kinds} afterwards.\n"
)
KINDS = ("number", "word", "uuid")


@dataclass
class NeedleSample:
    context_ids: Tensor  # [1, N]: chat prefix (or <bos>), instruction and haystack with the needle
    question_ids: Tensor  # [1, Q]: question, end of the user turn, assistant prefix and answer prefix
    answer: str  # the value: 7 digits, two words or a UUID
    answer_ids: Tensor  # [1, A]: the answer as the model would continue the answer prefix
    depth: float  # where the needle sits, as a fraction of the haystack
    kind: str = "number"
    text: str = "essays"


CHARS_PER_TOKEN = 12  # the essays' characters a sample reads per token of its context (a margin over ~4)


def make_samples(
    tokenizer,
    count: int,
    tokens: int,
    seed: int = 0,
    kinds: tuple[str, ...] = ("number",),
    texts: tuple[str, ...] = ("essays",),
) -> list[NeedleSample]:
    """``count`` seeded samples whose context is ``tokens`` tokens (± a sentence); sample i hides a value of
    ``kinds[i % len(kinds)]`` in ``texts[i // len(kinds) % len(texts)]``."""
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"kinds: unknown {kind!r}; known: {', '.join(KINDS)}")
    haystacks = {name: haystack_text(name) for name in dict.fromkeys(texts)}  # an unknown name: a clear ValueError
    samples = []
    for index in range(count):
        kind, name = kinds[index % len(kinds)], texts[index // len(kinds) % len(texts)]
        text = haystacks[name]
        rng = random.Random(f"needle:{seed}:{index}")
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        value = _value(kind, rng)
        start = rng.randrange(0, max(1, len(text) - CHARS_PER_TOKEN * tokens))
        haystack = tokenizer.decode(tokenizer(text[start : start + CHARS_PER_TOKEN * tokens]).input_ids[: tokens - 60])
        depth = rng.random()
        cut = haystack.rfind(". ", 0, int(len(haystack) * depth)) + 2  # after a sentence (0 if none before)
        context = haystack[:cut] + f"The special magic {kind} for {key} is: {value}. " + haystack[cut:]
        question = f"\nWhat is the special magic {kind} for {key} mentioned in the provided text?"
        chat = prompt_text(tokenizer, INSTRUCTION.format(kinds=kind + "s") + context + question)
        split = chat.rindex(question)
        encode = lambda s: tokenizer(s, return_tensors="pt", add_special_tokens=False).input_ids  # noqa: E731
        samples.append(
            NeedleSample(
                context_ids=encode(chat[:split]),
                question_ids=encode(
                    chat[split:] + f"The special magic {kind} for {key} mentioned in the provided text is"
                ),
                answer=value,
                answer_ids=encode(f" {value}."),
                depth=cut / max(len(haystack), 1),
                kind=kind,
                text=name,
            )
        )
    return samples


def _value(kind: str, rng: random.Random) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "word":
        return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def run(
    model,
    tokenizer,
    samples: list[NeedleSample],
    specs: dict[str, Any],
    max_new_tokens: int = 12,
    dense_layers: tuple[int, ...] = (),
    progress: bool = True,
) -> list[dict]:
    """Every sample's context prefilled once; every spec answers it → one record per (sample, spec)."""
    records = []
    handle = oa.patch(model, {"budget": {"density": 1.0}}, dense_layers=dense_layers)
    try:
        bar = tqdm(total=len(samples) * len(specs), desc="needle", unit="answer", disable=not progress)
        for index, sample in enumerate(samples):
            question, answer = sample.question_ids.to(model.device), sample.answer_ids.to(model.device)
            start = time.perf_counter()
            context = oa.prefill_context(model, sample.context_ids.to(model.device))
            prefill_s = time.perf_counter() - start
            for name, spec in specs.items():
                bar.set_description(f"needle: {name}")
                handle.use(spec)
                start = time.perf_counter()
                shared, rest = oa.share_question(model, context, question)  # its leading blocks attended once
                new = oa.generate_from_context(
                    model, shared, rest, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id
                )
                generate_s = time.perf_counter() - start
                stats = handle.stats
                handle.reset_stats()
                logprob = float(oa.answer_logprob(model, shared, rest, answer)[0])
                handle.reset_stats()
                text = tokenizer.decode(new[0], skip_special_tokens=True)
                records.append(
                    {
                        "sample": index,
                        "spec": name,
                        "kind": sample.kind,
                        "text": sample.text,
                        "answer": sample.answer,
                        "output": text,
                        "correct": sample.answer.lower() in text.lower(),
                        "answer_logprob": logprob,
                        "density": stats.density,
                        "context_tokens": sample.context_ids.shape[1],
                        "question_tokens": sample.question_ids.shape[1],
                        "depth": round(sample.depth, 3),
                        "prefill_s": round(prefill_s, 2),
                        "generate_s": round(generate_s, 2),
                        "prepare_s": round(stats.prepare_seconds, 2),
                        "sparse_attend_s": round(stats.attend_seconds, 2),
                    }
                )
                bar.update()
        bar.close()
    finally:
        handle.unpatch()
    return records


def summarize(records: list[dict], reference: str = "dense") -> dict[str, dict]:
    """Per spec: accuracy, mean read density, and the mean answer log-likelihood gap to ``reference``."""
    base = {r["sample"]: r["answer_logprob"] for r in records if r["spec"] == reference}
    summary = {}
    for name in dict.fromkeys(r["spec"] for r in records):
        rows = [r for r in records if r["spec"] == name]
        summary[name] = {
            "accuracy": sum(r["correct"] for r in rows) / len(rows),
            "density": sum(r["density"] for r in rows) / len(rows),
            "logprob_gap": sum(r["answer_logprob"] - base[r["sample"]] for r in rows) / len(rows),
            "samples": len(rows),
        }
    return summary
