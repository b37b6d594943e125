"""The evaluation runner: models × specs × densities × tasks × lengths, each context prefilled once per sample.

    config = EvalConfig(specs=["specs/openattention.yaml", "specs/oracle-topk.yaml"], densities=[0.1, 0.03],
                        tasks=["niah_single_2", "vt"], lengths=[4096], samples=20, out=Path("runs/ruler"))
    run(config)                # records.jsonl (one line per cell) and summary.csv / summary.json under ``out``

A *unit* is one (length, task, batch of samples): its contexts are prefilled densely once and every (spec, density)
*cell* answers them from its own copy of the cache (setup B: question and answer decoded sparsely; A: question dense).
``batch`` > 1 decodes up to that many samples of a task together — the samples whose questions have the same token
length, contexts left-padded (every component reads and clusters only a row's valid tokens, its budget counted on its
own length): the per-step overhead that bounds a small model on a GPU is paid once per batch, not per sample (a
record's measured density, times and ``prefill_peak_gib`` / ``peak_gib`` — the GPU memory its rank had allocated at
most during the prefill and the cell, None on the CPU — are then its batch's). A spec whose own budget is the whole
context (``specs/dense.yaml``) is the reference: run once per unit, not per density, and added when no spec is dense —
retention and the log-likelihood gap are measured against it.

Resumable: each finished cell is appended to ``records[-rankR].jsonl`` and flushed to disk at once; a run started
again over the same ``out`` skips the cells already there (and the units whose cells all are), so a crash or Ctrl-C
loses at most the cell in flight. Under ``torchrun --nproc-per-node N`` the cells still to run are dealt to the
ranks in turn (torch.distributed, gloo on the CPU), each writes its own records, and rank 0 writes the summary of all
of them.
"""

from __future__ import annotations

import functools
import os
import platform
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from pathlib import Path

import torch

import oa_core as oa
from oa_core.analysis.offline_model import head_dim, model_label
from oa_core.analysis.provenance import provenance
from oa_core.eval import ruler
from oa_core.eval.config import EvalConfig, check_budgets, check_config, resolved_specs, spec_name  # noqa: F401
from oa_core.eval.memory import (
    WorkQueue,
    claim_solver,
    peak_gib,
    release,
    reset_peak,
    retry_after_oom,
)
from oa_core.eval.records import (
    ATTENTION_ERROR,
    ErrorRecord,
    RecordWriter,
    RulerRecord,
    cell_key,
    generator_of,
    read_records,
    record_key,
    summarize,
    write_summary,
)


def sample_batches(question_tokens: list[int], size: int) -> list[tuple[int, ...]]:
    """Sample indices in batches of at most ``size`` whose questions have the same token length (their setup-B
    split then lines up: contexts left-padded, questions stacked), in the order of each batch's first sample."""
    groups: dict[int, list[int]] = defaultdict(list)
    for index, tokens in enumerate(question_tokens):
        groups[tokens].append(index)
    batches = [tuple(group[i : i + size]) for group in groups.values() for i in range(0, len(group), size)]
    return sorted(batches)


def cells_of_unit(
    specs: dict[str, tuple[dict, bool]],
    densities: Iterable[float],
    task: str,
    length: int,
    samples: tuple[int, ...],
    done: AbstractSet[tuple] = frozenset(),
) -> list[tuple[tuple, dict, tuple]]:
    """The unit's cells not yet ``done``, in order — the dense reference first — each (key of its first sample, spec
    mapping with its budget, the samples still missing it)."""
    cells = []
    for name, (data, dense) in sorted(specs.items(), key=lambda item: not item[1][1]):
        for density in [None] if dense else densities:
            spec = data if dense else {**data, "budget": {"density": density}}
            missing = tuple(i for i in samples if cell_key(name, density, task, length, i) not in done)
            if missing:
                cells.append((cell_key(name, density, task, length, samples[0]), spec, missing))
    return cells


def _distributed() -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group (gloo) when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    return (torch.distributed.get_rank(), world) if world > 1 else (0, 1)


def run(config: EvalConfig, model=None, tokenizer=None) -> list[dict] | None:
    """Runs every cell not yet under ``config.out``; → the summary rows (on rank 0; None on the others)."""
    check_config(config)
    specs = resolved_specs(config)
    check_budgets(specs, config)
    rank, world = _distributed()
    device = _rank_device(config.device, world) if config.device else None  # a clear error before the model loads
    out = Path(config.out)
    records = read_records(out)
    check_generator(records, config, out)
    if config.metric == "ruler":
        ruler.check_dependencies()
    done = {record_key(r) for r in records}
    if config.metric == "ruler" and not _ruler_missing(specs, config, done):
        return _summarize(out, rank, world)  # every cell is done: no model to load (a resumed sweep's phase)
    if model is None:
        from oa_core.analysis.offline_model import load_offline_model

        model, tokenizer = load_offline_model(config.model)
        device = device or _rank_device("cuda" if torch.cuda.is_available() else "cpu", world)
    if config.metric == "ruler":
        warn_past_positions(model.config, config.lengths)
    if device is not None:
        model.to(device)
        claim_solver(device)
    samples: dict[tuple[str, int], list[ruler.Sample]] = {}
    if config.metric == "ruler":
        units = []
        for length in config.lengths:
            for task in config.tasks:
                samples[task, length] = ruler.generate(task, tokenizer, length, config.samples, seed=config.seed)
                questions = [len(encode(tokenizer, s.question)) for s in samples[task, length]]
                units += [(task, length, batch) for batch in sample_batches(questions, config.batch)]
    else:
        from oa_core.analysis.attention_error import default_layers

        layers = config.layers or default_layers(model.config.num_hidden_layers)
        units = [(ATTENTION_ERROR, length, (layer,)) for length in config.lengths for layer in layers]
    if world > 1:
        torch.distributed.barrier()  # every rank has read what is done before any writes more: they deal alike
    pairs = [(unit, cell) for unit in units for cell in cells_of_unit(specs, config.densities, *unit, done)]
    todo = deal_to_ranks(pairs, rank, world)
    total = sum(len(missing) for _, cells in todo for *_, missing in cells)
    meta = {
        "model": model_label(config.model),
        "head_dim": head_dim(model.config),
        "setup": config.setup,
        "seed": config.seed,
        "metric": config.metric,
        "versions": {
            "openattention": oa.__version__,
            "torch": torch.__version__,
            "transformers": _transformers_version(),
            "python": platform.python_version(),
        },
        "provenance": provenance(model.device),
    }
    writer = RecordWriter(out / (f"records-rank{rank}.jsonl" if world > 1 else "records.jsonl"))
    skipped = []
    try:
        if config.metric == "ruler":
            skipped = _run_cells(model, tokenizer, config, samples, todo, total, meta, writer, rank)
        else:
            _run_error_cells(model, tokenizer, config, todo, total, meta, writer, rank)
    finally:
        writer.close()
    rows = _summarize(out, rank, world)
    if skipped:
        raise IncompleteRun(
            f"{len(skipped)} cell(s) on rank {rank} ran out of memory twice with one sample, at "
            f"their turn and again at the end, and are not in {out}; the summary has the rest. Run the "
            "same command again to retry them (with fewer ranks per GPU or a smaller --batch if it "
            "happens again)"
        )
    return rows


def warn_past_positions(model_config, lengths: Iterable[int]) -> None:
    """A warning where RULER's prompts (whose length counts the question) leave the answer no position the model was
    trained on (``max_position_embeddings``): answers there, dense's included, say little about a method (SmolLM2-135M
    at 8K answered 2 of 20 needles dense)."""
    trained = getattr(model_config, "max_position_embeddings", None)
    past = [n for n in lengths if trained and n >= trained]
    if past:
        warnings.warn(
            f"lengths {', '.join(f'{n:,}' for n in past)}: prompts that long leave the answer past the {trained:,} "
            "positions the model was trained on (max_position_embeddings); its scores there, dense's included, say "
            "little about a method",
            RuntimeWarning,
            stacklevel=3,
        )


def check_generator(records: list[dict], config: EvalConfig, out: Path) -> None:
    """A clear error, before any model loads, for RULER cells to be added to a folder whose records another RULER
    generator made: their scores are of other samples and do not compare (a report would have to keep them apart)."""
    others = {generator_of(r) for r in records} - {ruler.GENERATOR, ""}
    if config.metric == "ruler" and others:
        raise ValueError(
            f"out: {out} holds RULER records of the generator {', '.join(sorted(others))}, this one is "
            f"{ruler.GENERATOR}: their samples differ and their scores do not compare; pass another --out"
        )


def _ruler_missing(specs: dict[str, tuple[dict, bool]], config: EvalConfig, done: set[tuple]) -> bool:
    """Whether some RULER cell of the run is not yet ``done``: known without the model or its tokenizer (which the
    units' batches need), from each (task, length)'s samples taken as one unit."""
    every = tuple(range(config.samples))
    return any(
        cells_of_unit(specs, config.densities, task, length, every, done)
        for task in config.tasks
        for length in config.lengths
    )


def _summarize(out: Path, rank: int, world: int) -> list[dict] | None:
    """Rank 0 writes the summary over every rank's records, once all have finished; → its rows (None elsewhere)."""
    if world > 1:
        torch.distributed.barrier()
    rows = None
    if rank == 0:
        rows = summarize(read_records(out))
        write_summary(out, rows)
    if world > 1:
        torch.distributed.barrier()  # the summary is written before any rank reports an incomplete run
    return rows


class IncompleteRun(RuntimeError):
    """Some cells could not run (out of memory); everything else was written, summary included."""


def deal_to_ranks(cells: list[tuple], rank: int, world: int) -> list[tuple]:
    """This rank's share of the (unit, cell) pairs still to run, one in ``world`` in turn, grouped back by unit
    (a unit's context is prefilled once per rank that has cells of it). Dealing cells, not units: a rerun's missing
    cells often sit in a few units, and a unit's cells are many (specs × densities) and slow one after another."""
    mine: dict[tuple, list] = {}
    for unit, cell in cells[rank::world]:
        mine.setdefault(unit, []).append(cell)
    return list(mine.items())


def _rank_device(device: str, world: int) -> torch.device:
    """``device``; under torchrun a bare ``cuda`` is the rank's local GPU (LOCAL_RANK modulo the GPUs: more ranks
    than GPUs share them)."""
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device: {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {chosen} asked for, but torch sees no CUDA device here")
    if chosen.type == "cuda" and chosen.index is None and world > 1:
        chosen = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return chosen


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def encode(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]


def _padded(rows: list[torch.Tensor], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths as one ``[B, L]`` batch and its mask (padding on the left or the right)."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = row, 1
    return ids, mask


def pad_id(tokenizer) -> int:
    """The token that pads a batch's contexts and answers: the tokenizer's pad token, else its end of sequence."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def batch_prompts(tokenizer, batch: list[ruler.Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch as ``oa eval`` decodes it: the contexts left-padded ``[B, N]`` with their mask, and the questions
    stacked ``[B, Q]`` (of one token length: ``sample_batches``)."""
    context_ids, context_mask = _padded([encode(tokenizer, s.context) for s in batch], pad_id(tokenizer), left=True)
    return context_ids, context_mask, torch.stack([encode(tokenizer, s.question) for s in batch])


def _run_cells(
    model, tokenizer, config: EvalConfig, samples: dict, todo, total: int, meta: dict, writer: RecordWriter, rank: int
) -> list[tuple]:
    """Runs the cells (``WorkQueue`` decides what becomes of those that run out of memory) → the keys of those left
    for a rerun."""
    from tqdm import tqdm

    handle = oa.patch(model, {"budget": {"density": 1.0}}, setup=config.setup)
    bar = tqdm(
        total=total,
        desc=f"eval (rank {rank})" if rank else "eval",
        unit="cell",
        disable=not config.progress,
        position=rank,
    )
    pad = pad_id(tokenizer)
    device = model.device
    queue = WorkQueue(todo)
    try:
        while queue:
            (task, length, indices), cells = queue.next()
            batch = [samples[task, length][i] for i in indices]
            context_ids, context_mask, question_ids = batch_prompts(tokenizer, batch)
            question_ids = question_ids.to(device)
            answer_ids, answer_mask = _padded([encode(tokenizer, reference_answer(s)) for s in batch], pad, left=False)
            answer_ids, answer_mask = answer_ids.to(device), answer_mask.to(device)
            reset_peak(device)
            start = time.perf_counter()
            context = retry_after_oom(
                functools.partial(_prefill, model, context_ids, context_mask, device), handle, device
            )
            prefill_s, prefill_peak = time.perf_counter() - start, peak_gib(device)
            failed = cells if context is None else []  # this batch's cells that ran out of memory twice
            for cell in cells if context is not None else ():
                key, spec, missing = cell
                handle.use(spec)
                reset_peak(device)
                answered = retry_after_oom(
                    functools.partial(
                        _answer,
                        model,
                        tokenizer,
                        handle,
                        context,
                        question_ids,
                        answer_ids,
                        answer_mask,
                        config.max_new_tokens or batch[0].max_new_tokens,
                    ),
                    handle,
                    device,
                )
                if answered is None:
                    failed.append(cell)
                    continue
                new, seconds, density, logprobs = answered
                name, target, *_ = key
                peak = peak_gib(device)
                resolved = oa.build(spec).resolved_spec()
                for row, (index, sample) in enumerate(zip(indices, batch)):
                    if index not in missing:
                        continue
                    output = tokenizer.decode(new[row], skip_special_tokens=True)
                    writer.write(
                        RulerRecord(
                            spec=name,
                            density=target,
                            task=task,
                            length=length,
                            sample=index,
                            score=ruler.score(sample.metric, output, sample.answers),
                            answer_logprob=logprobs[row],
                            measured_density=density,
                            resolved_spec=resolved,
                            **meta,
                            generator=ruler.GENERATOR,
                            output=output,
                            answers=sample.answers,
                            prompt_tokens=sample.tokens,
                            context_tokens=int(context_mask[row].sum()),
                            question_tokens=question_ids.shape[1],
                            batch=len(indices),
                            prefill_s=round(prefill_s, 3),
                            generate_s=round(seconds, 3),
                            device=str(device),
                            prefill_peak_gib=prefill_peak,
                            peak_gib=peak,
                        )
                    )
                bar.update(len(missing))
                release(device)  # ranks sharing a GPU: this cell's peak back to the others
            where = " in the prefill" if context is None else ""
            del context  # before the halves run
            if failed:
                what = queue.out_of_memory(task, length, indices, failed)
                samples_text = f"sample {indices[0]}" if len(indices) == 1 else f"samples {list(indices)}"
                bar.write(
                    f"eval (rank {rank}): {len(failed)} cell(s) of {task} ({samples_text}) ran out of memory "
                    f"twice{where}: {what}"
                )
    finally:
        bar.close()
        handle.unpatch()
    return queue.skipped


def _prefill(model, context_ids, context_mask, device: torch.device):
    """One batch's prompts prefilled, copied to the device inside the work (so that a retry after running out of
    memory copies them again)."""
    return oa.prefill_context(model, context_ids.to(device), context_mask.to(device))


def _answer(model, tokenizer, handle, context, question_ids, answer_ids, answer_mask, max_new_tokens: int):
    """One cell's work on one batch → (new tokens, generation seconds, measured density, answer log-likelihoods)."""
    start = time.perf_counter()
    shared, rest = oa.share_question(model, context, question_ids)  # its leading blocks attended once for both
    new = oa.generate_from_context(
        model, shared, rest, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id
    )
    seconds = time.perf_counter() - start
    density = handle.stats.density
    handle.reset_stats()
    logprobs = oa.answer_logprob(model, shared, rest, answer_ids, answer_mask).tolist()
    handle.reset_stats()
    return new, seconds, density, logprobs


def _run_error_cells(
    model, tokenizer, config: EvalConfig, todo, total: int, meta: dict, writer: RecordWriter, rank: int
) -> None:
    """attention-error (``oa_core.analysis.attention_error``'s protocol): per length, one forward pass over the essay
    haystack captures each layer's attention inputs; a unit is one layer — its first ``length`` keys are the cache,
    the queries of the 256 positions before are QGC's prefill queries, the ``decode`` after are decode queries over
    the cache; a cell's score is their mean relative output error against dense attention."""
    from tqdm import tqdm

    from oa_core.analysis.attention_error import attend_case, haystack_ids, layer_case
    from oa_core.analysis.offline_model import capture_attention

    bar = tqdm(
        total=total,
        desc=f"attention error (rank {rank})" if rank else "attention error",
        unit="cell",
        disable=not config.progress,
        position=rank,
    )
    captured: dict[int, dict] = {}  # the current length's layers
    try:
        for (_, length, (layer,)), cells in todo:
            if length not in captured:
                wanted = sorted({unit[2][0] for unit, _ in todo if unit[1] == length})
                captured = {length: capture_attention(model, haystack_ids(tokenizer, length + config.decode), wanted)}
            case = layer_case(captured[length][layer], length, config.decode)
            for key, spec, _ in cells:
                start = time.perf_counter()
                error, stats, pipe, extra = attend_case(spec, case, config.seed, config.diagnostics)
                error = error.flatten()
                name, target, *_ = key
                writer.write(
                    ErrorRecord(
                        spec=name,
                        density=target,
                        task=ATTENTION_ERROR,
                        length=length,
                        sample=layer,
                        score=error.mean().item(),
                        answer_logprob=None,
                        measured_density=stats.density,
                        resolved_spec=pipe.resolved_spec(),
                        **meta,
                        p90_error=error.quantile(0.9).item(),
                        decode_queries=case.queries.shape[2],
                        seconds=round(time.perf_counter() - start, 3),
                        diagnostics={k: v.float().mean().item() for k, v in extra.items()},
                    )
                )
                bar.update()
    finally:
        bar.close()


def reference_answer(sample: ruler.Sample) -> str:
    """The references as one continuation of the answer prefix (for the teacher-forced log-likelihood)."""
    lead = "" if sample.question.endswith((" ", "\n")) else " "
    return lead + ", ".join(sample.answers) + "."
