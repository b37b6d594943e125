"""The evaluation runner on a real (tiny, randomly initialised) Llama through the real integration: the cells it runs,
the dense reference, resuming after a crash to the same summary, and clear errors."""

import json
import math
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import oa_core as oa
from oa_core.eval import memory, runner
from oa_core.eval import records as eval_records

SPECS = ["specs/openattention.yaml", "specs/oracle-topk.yaml"]


@pytest.fixture(scope="module", autouse=True)
def torch_paths(tmp_path_factory):
    """The components' torch paths on the CPU, not Triton's interpreter (the kernels have tests of their own); the
    generated samples cached in a temporary folder, not the user's."""
    from oa_core.ops import triton_path

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_path, "interpreting", lambda: False)
        patch.setenv("OA_CACHE_DIR", str(tmp_path_factory.mktemp("ruler-cache")))
        yield


@pytest.fixture(scope="module")
def model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    return LlamaForCausalLM(config).eval()


def _config(out, **overrides):
    base = dict(
        specs=SPECS,
        densities=[0.1],
        tasks=["niah_single_1", "vt"],
        lengths=[1024],
        samples=2,
        out=Path(out),
        max_new_tokens=3,
        progress=False,
        sink=4,
        local=16,
    )
    return runner.EvalConfig(**{**base, **overrides})


def _comparable(rows):
    return json.dumps(rows, sort_keys=True)


@pytest.fixture(scope="module")
def uninterrupted(model, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-full")
    rows = runner.run(_config(out), model, tokenizer)
    return out, rows


def test_every_cell_runs_once_with_the_dense_reference(uninterrupted):
    out, rows = uninterrupted
    records = eval_records.read_records(out)
    # 2 tasks × 2 samples, each: dense once + 2 specs at one density
    assert len(records) == 4 * (1 + 2) == len({eval_records.record_key(r) for r in records})
    dense = [r for r in records if r["spec"] == "dense"]
    assert len(dense) == 4 and all(r["density"] is None and r["measured_density"] == 1.0 for r in dense)
    sparse = [r for r in records if r["spec"] != "dense"]
    for r in sparse:
        assert r["measured_density"] < 1.0  # really sparse
        assert r["resolved_spec"]["budget"]["density"] == r["density"] and r["resolved_spec"]["local"] == 16
        ran = oa.build(r["resolved_spec"])
        for kind in ("clusterer", "selector", "allocator"):  # every param, defaults too: a later default cannot relabel
            assert set(r["resolved_spec"][kind]["params"]) == set(type(getattr(ran, kind).config).model_fields)
        assert r["model"] and r["versions"]["openattention"] and r["setup"] == "B" and r["seed"] == 0
        assert r["device"] == "cpu" and r["prefill_peak_gib"] is r["peak_gib"] is None  # (a GPU's peaks)
        assert set(r["provenance"]) == {"commit", "dirty", "machine"} and r["provenance"]["machine"]  # what ran it
    assert {(r["spec"], r["density"], r["task"]) for r in rows} == {
        ("dense", 1.0, t) for t in ("niah_single_1", "vt")
    } | {(s, 0.1, t) for s in ("openattention", "oracle-topk") for t in ("niah_single_1", "vt")}
    assert (out / "summary.csv").read_text().splitlines()[0].split(",") == list(eval_records.SUMMARY_FIELDS)
    from oa_core.eval import ruler

    assert {r["generator"] for r in records} == {ruler.GENERATOR} == {r["generator"] for r in rows}
    for row in rows:
        if row["spec"] == "dense":
            assert row["logprob_gap"] == 0.0


def test_a_crashed_run_resumes_to_the_same_summary(model, tokenizer, uninterrupted, tmp_path, monkeypatch):
    _, full = uninterrupted
    written = []
    original = eval_records.RecordWriter.write

    def crash_after_five(self, record):
        if len(written) == 5:
            raise KeyboardInterrupt  # Ctrl-C in the middle of a unit
        written.append(record)
        original(self, record)

    monkeypatch.setattr(eval_records.RecordWriter, "write", crash_after_five)
    with pytest.raises(KeyboardInterrupt):
        runner.run(_config(tmp_path), model, tokenizer)
    monkeypatch.setattr(eval_records.RecordWriter, "write", original)
    assert len(eval_records.read_records(tmp_path)) == 5  # nothing written was lost
    with (tmp_path / "records.jsonl").open("a") as f:
        f.write('{"spec": "openattention", "dens')  # a line cut short by the crash: ignored, its cell runs again

    ran = []
    monkeypatch.setattr(
        eval_records.RecordWriter, "write", lambda self, record: (ran.append(record), original(self, record))
    )
    rows = runner.run(_config(tmp_path), model, tokenizer)
    assert len(ran) == 12 - 5  # only the cells not yet done
    assert _comparable(rows) == _comparable(full)


def test_a_finished_run_again_loads_no_model(uninterrupted, tmp_path, monkeypatch):
    """A resumed sweep's finished phase: nothing to run, so no model (nor its tokenizer) is loaded; one cell missing
    and it is."""
    import shutil

    from oa_core.analysis import offline_model

    full_out, full = uninterrupted
    out = tmp_path / "copy"
    shutil.copytree(full_out, out)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(offline_model, "load_offline_model", no_model)
    before = (out / "records.jsonl").read_bytes()
    assert _comparable(runner.run(_config(out))) == _comparable(full)
    assert (out / "records.jsonl").read_bytes() == before
    lines = before.decode().splitlines(keepends=True)
    (out / "records.jsonl").write_text("".join(lines[:-1]))  # one cell missing
    with pytest.raises(AssertionError, match="the model was loaded"):
        runner.run(_config(out))


@pytest.mark.parametrize(
    "where, failures", [("answer", 1), ("answer", 2), ("answer", 4), ("prefill", 2), ("prefill", 4)]
)
def test_out_of_memory_is_retried_then_left_for_a_rerun(
    model, tokenizer, uninterrupted, tmp_path, monkeypatch, where, failures
):
    """Out of memory twice with one sample: the cells go to the end of the rank's queue; twice more there: left for a
    rerun, which runs them."""
    full_out, full = uninterrupted
    owner, name = (runner, "_answer") if where == "answer" else (runner.oa, "prefill_context")
    original, first, calls = getattr(owner, name), [], []

    def short_of_memory(*args, **kwargs):  # the first cell's (or unit's) first ``failures`` tries
        which = (
            args[1].tolist()
            if where == "prefill"
            else (repr(args[2].runtimes[0].pipeline), args[4].tolist(), args[5].tolist())
        )
        first[:] = first or [which]
        if which == first[0] and len(calls) < failures:
            calls.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, short_of_memory)
    cells = 1 if where == "answer" else 3  # a cell; or, with no prefilled context, the unit's three cells
    in_order = [eval_records.record_key(r) for r in eval_records.read_records(full_out)]
    if failures < 4:  # answered at once (one failure), or at the end of the run (two): nothing is missing
        assert _comparable(runner.run(_config(tmp_path), model, tokenizer)) == _comparable(full)
        written = [eval_records.record_key(r) for r in eval_records.read_records(tmp_path)]
        assert written == in_order if failures == 1 else written == in_order[cells:] + in_order[:cells]
        return
    with pytest.raises(runner.IncompleteRun, match=f"{cells} cell.*ran out of memory twice with one sample.*again"):
        runner.run(_config(tmp_path), model, tokenizer)
    assert len(eval_records.read_records(tmp_path)) == 12 - cells  # every other cell ran, the summary of them written
    assert (tmp_path / "summary.json").is_file()
    monkeypatch.setattr(owner, name, original)
    rows = runner.run(_config(tmp_path), model, tokenizer)  # the rerun runs what was left
    assert _comparable(rows) == _comparable(full)


def test_a_batch_out_of_memory_runs_again_in_halves(model, tokenizer, tmp_path, monkeypatch):
    """A batch whose prefill, then one cell's answer, run out of memory twice is split in halves until it fits: every
    cell is answered in one run, each record with the batch it was decoded in."""
    from oa_core.eval import ruler

    config = _config(
        tmp_path, specs=["specs/oracle-topk.yaml"], tasks=["niah_single_2"], samples=6, batch=4, lengths=[512]
    )
    samples = ruler.generate("niah_single_2", tokenizer, 512, 6)
    first = runner.sample_batches([len(runner.encode(tokenizer, s.question)) for s in samples], 4)[0]
    assert len(first) >= 3, "the test needs a batch of three samples or more"
    prefill, answer, sizes = runner.oa.prefill_context, runner._answer, []

    def prefill_fits_one(model, ids, mask):  # the prefill of more than one sample runs out of memory
        sizes.append(("prefill", len(ids)))
        if len(ids) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return prefill(model, ids, mask)

    def answer_fits_one(model, tokenizer, handle, context, question_ids, *args):  # so does oracle-topk's answer
        sizes.append(("answer", len(question_ids)))
        if len(question_ids) > 1 and handle.runtimes[0].pipeline.spec.budget.density < 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return answer(model, tokenizer, handle, context, question_ids, *args)

    monkeypatch.setattr(runner.oa, "prefill_context", prefill_fits_one)
    runner.run(config, model, tokenizer)
    records = eval_records.read_records(tmp_path)
    assert sorted(eval_records.record_key(r) for r in records) == sorted(
        eval_records.cell_key(spec, density, "niah_single_2", 512, i)
        for spec, density in (("dense", None), ("oracle-topk", 0.1))
        for i in range(6)
    )
    assert all(r["batch"] == 1 for r in records if r["sample"] in first)
    assert sizes[:2] == [("prefill", len(first))] * 2  # tried twice with the whole batch before it is split

    other = tmp_path / "answer"
    monkeypatch.setattr(runner.oa, "prefill_context", prefill)
    monkeypatch.setattr(runner, "_answer", answer_fits_one)
    same = ("specs", "tasks", "samples", "batch", "lengths")
    runner.run(_config(other, **{k: getattr(config, k) for k in same}), model, tokenizer)
    records = eval_records.read_records(other)
    assert len(records) == 12
    batch = {(r["spec"], r["sample"]): r["batch"] for r in records}
    for i in first:
        assert batch["dense", i] == len(first)  # the cell that fitted ran once, with the whole batch
        assert batch["oracle-topk", i] == 1


def test_bad_arguments_are_named(model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unknown 'qa_1'"):
        runner.run(_config(tmp_path, tasks=["qa_1"]), model, tokenizer)
    with pytest.raises(ValueError, match=r"densities: 1.5"):
        runner.run(_config(tmp_path, densities=[1.5]), model, tokenizer)
    with pytest.raises(ValueError, match="setup"):
        runner.run(_config(tmp_path, setup="C"), model, tokenizer)
    with pytest.raises(ValueError, match="batch: expected at least 1, got 0"):
        runner.run(_config(tmp_path, batch=0), model, tokenizer)
    with pytest.raises(ValueError, match="device: 'gpu' is not a torch device"):
        runner.run(_config(tmp_path, device="gpu"), model, tokenizer)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: cuda asked for, but torch sees no CUDA device"):
            runner.run(_config(tmp_path, device="cuda"), model, tokenizer)
    with pytest.raises(ValueError, match="metric: unknown 'bleu'; known: ruler, attention-error"):
        runner.run(_config(tmp_path, metric="bleu"), model, tokenizer)
    with pytest.raises(ValueError, match="attention error needs at least 256 tokens, got 100"):
        runner.run(_config(tmp_path, metric="attention-error", lengths=[100], layers=[0]), model, tokenizer)
    from oa_core.spec import SpecError

    with pytest.raises((SpecError, FileNotFoundError)):
        runner.run(_config(tmp_path, specs=["specs/no-such-spec.yaml"]), model, tokenizer)


def test_oa_eval_names_bad_input(tmp_path, capsys):
    from oa_core.cli import main

    assert main(["eval", "--specs", str(tmp_path / "missing.yaml"), "--out", str(tmp_path)]) == 2
    assert "oa eval: spec file not found" in capsys.readouterr().err
    assert main(["eval", "--specs", "specs/openattention.yaml", "--tasks", "qa_1", "--out", str(tmp_path)]) == 2
    assert "oa eval: tasks: unknown 'qa_1'; known: niah_single_1" in capsys.readouterr().err


def test_oa_eval_refuses_bad_numbers_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from oa_core.analysis import offline_model
    from oa_core.cli import main

    monkeypatch.setattr(offline_model, "load_offline_model", lambda *_, **__: pytest.fail("a model loaded"))
    for args, message in (
        (["--samples", "0"], "samples: expected at least 1, got 0"),
        (["--length", "0"], "lengths: expected positive token counts, got [0]"),
        (["--max-new-tokens", "0"], "max_new_tokens: expected at least 1, got 0"),
        (["--local-window", "-1"], "local: expected at least 0, got -1"),
        (["--densities", "2"], "densities: 2.0 is outside (0, 1]"),
    ):
        assert main(["eval", "--specs", "specs/openattention.yaml", "--out", str(tmp_path), *args]) == 2, args
        assert f"oa eval: {message}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no summary, no records


def test_oa_eval_says_when_it_overrides_the_specs_sink_or_local(tmp_path, capsys, monkeypatch):
    from oa_core.analysis import offline_model
    from oa_core.cli import main

    monkeypatch.setattr(offline_model, "load_offline_model", lambda *_, **__: pytest.fail("a model loaded"))
    assert (
        main(
            [
                "eval",
                "--specs",
                "specs/openattention.yaml",
                "--local-window",
                "16",
                "--samples",
                "0",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "oa eval: local window 16 for every sparse spec (openattention: 64)" in capsys.readouterr().err


def test_cells_are_dealt_in_turn_and_grouped_by_unit():
    pairs = [(unit, cell) for unit in ("u0", "u1", "u2") for cell in range(5)]  # a unit's cells: specs × densities
    shares = [runner.deal_to_ranks(pairs, rank, 4) for rank in range(4)]
    dealt = [(unit, cell) for share in shares for unit, cells in share for cell in cells]
    assert sorted(dealt) == sorted(pairs)  # every cell once
    assert [sum(len(cells) for _, cells in share) for share in shares] == [4, 4, 4, 3]
    assert shares[1] == [("u0", [1]), ("u1", [0, 4]), ("u2", [3])]  # one entry per unit: one prefill


def test_torchrun_splits_the_cells_over_two_processes(model, tokenizer, tmp_path):
    """``torchrun --nproc-per-node 2 -m oa_core.cli eval``: gloo on the CPU, the cells dealt to both ranks, each
    run once, and one summary over both ranks' records — the same as one process's."""
    import os
    import shutil
    import subprocess

    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "ranks"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "OA_CACHE_DIR": str(tmp_path / "cache"),
    }
    command = [
        torchrun,
        "--nproc-per-node",
        "2",
        "--master-port",
        "29531",
        "-m",
        "oa_core.cli",
        "eval",
        "--model",
        str(folder),
        "--specs",
        *SPECS,
        "--densities",
        "0.1",
        "--tasks",
        "niah_single_1",
        "vt",
        "--length",
        "1024",
        "--samples",
        "2",
        "--max-new-tokens",
        "3",
        "--sink",
        "4",
        "--local-window",
        "16",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "records-rank0.jsonl").is_file() and (out / "records-rank1.jsonl").is_file()
    records = eval_records.read_records(out)
    assert len(records) == 12 == len({eval_records.record_key(r) for r in records})
    for rank in (0, 1):  # the cells are dealt in turn: each rank has half of them, from every unit
        mine = [json.loads(line) for line in (out / f"records-rank{rank}.jsonl").read_text().splitlines()]
        assert len(mine) == 6 and len({(r["task"], r["sample"]) for r in mine}) == 4
    rows = json.loads((out / "summary.json").read_text())
    single = runner.run(_config(tmp_path / "single"), model, tokenizer)
    assert [(r["spec"], r["density"], r["task"], r["samples"], r["score"]) for r in rows] == [
        (r["spec"], r["density"], r["task"], r["samples"], r["score"]) for r in single
    ]
    for a, b in zip(rows, single):
        assert a["logprob_gap"] == pytest.approx(b["logprob_gap"], abs=1e-3)


def _colored_fraction(path):
    import numpy as np
    from PIL import Image

    Image.open(path).verify()  # a valid PNG
    pixels = np.asarray(Image.open(path).convert("RGB"), dtype=float)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 500
    return float(((pixels.max(-1) - pixels.min(-1)) > 60).mean())  # lines and bars; axes and text are grey


def test_report_renders_tables_and_plots(tmp_path, capsys):
    from oa_core.cli import main

    records = []
    for task, dense_score in (("niah_single_2", 80.0), ("vt", 60.0), ("cwe", 0.0)):
        for sample in range(2):
            records.append(
                dict(
                    spec="dense",
                    density=None,
                    task=task,
                    length=4096,
                    sample=sample,
                    score=dense_score,
                    answer_logprob=-2.0,
                    measured_density=1.0,
                )
            )
            for density, factor in ((0.1, 1.0), (0.01, 0.5)):
                records.append(
                    dict(
                        spec="openattention",
                        density=density,
                        task=task,
                        length=4096,
                        sample=sample,
                        score=dense_score * factor,
                        answer_logprob=-2.0 - (1 - factor),
                        measured_density=density,
                    )
                )
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    # Means over the tasks dense can do (niah 80, vt 60; cwe 0 is reported apart), beside dense's on those tasks.
    # The mean's 95% Wilson interval over its 4 samples beside it (35 of 100: 8 to 77).
    assert "| openattention | 1% | 2 | 35.0 (8–77) | 70.0 | 0.50 | -0.50 | 0.0100 |" in text
    assert "| openattention | 10% | 2 | 70.0 (27–94) | 70.0 | 1.00 | +0.00 | 0.1000 |" in text
    assert "| openattention | 1% | vt | 4096 | 2 | 30.0 (" in text  # per task too
    assert f"Samples: `{eval_records.LEGACY_GENERATOR}`" in text  # records naming no generator: the old one's
    assert "## Tasks the model cannot do even dense\n\ncwe (4096)" in text
    summary = json.loads((tmp_path / "summary.json").read_text())  # written from the records too
    assert len(summary) == 3 * 3 and {(r["spec"], r["task"]) for r in summary} == {
        (r["spec"], r["task"]) for r in records
    }
    assert _colored_fraction(tmp_path / "per_task.png") > 0.05  # the bars
    assert _colored_fraction(tmp_path / "accuracy_vs_density.png") > 0.002  # the line and its markers
    assert main(["report", str(tmp_path / "nothing-here")]) == 2
    assert "no records" in capsys.readouterr().err


def test_a_score_interval_is_wilsons():
    """Textbook values: 10 of 20 → [29.9, 70.1], 20 of 20 → [83.9, 100], 0 of 20 → [0, 16.1] (×100)."""
    for mean, (low, high) in ((50.0, (29.93, 70.07)), (100.0, (83.89, 100.0)), (0.0, (0.0, 16.11))):
        assert eval_records.wilson_interval(mean, 20) == pytest.approx((low, high), abs=0.01)
    narrow, wide = eval_records.wilson_interval(50.0, 200), eval_records.wilson_interval(50.0, 20)
    assert narrow[1] - narrow[0] < (wide[1] - wide[0]) / 2.5  # ten times the samples: about 1/√10 of the width


def _generator_records(generator):
    made = {} if generator is None else {"generator": generator}
    return [
        dict(
            spec=spec,
            density=density,
            task="vt",
            length=4096,
            sample=sample,
            score=score,
            answer_logprob=-1.0,
            measured_density=density or 1.0,
            **made,
        )
        for sample in range(2)
        for spec, density, score in (("dense", None, 100.0), ("quest", 0.1, 50.0))
    ]


def test_records_of_two_generators_never_meet_in_a_table(tmp_path, capsys):
    from oa_core.cli import main
    from oa_core.eval import ruler

    old, new = _generator_records(None), _generator_records(ruler.GENERATOR)
    for r in new:
        r["score"] = 0.0 if r["spec"] == "quest" else r["score"]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old + new))
    rows = eval_records.summarize(eval_records.read_records(tmp_path))
    quest = {r["generator"]: r for r in rows if r["spec"] == "quest"}
    assert {g: (r["score"], r["samples"]) for g, r in quest.items()} == {
        eval_records.LEGACY_GENERATOR: (50.0, 2),
        ruler.GENERATOR: (0.0, 2),
    }
    assert "| generator |" in eval_records.summary_table(rows)  # marked when a table has several
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"2 generators, {eval_records.LEGACY_GENERATOR} (4 cells), {ruler.GENERATOR} (4 cells)" in err
    assert "--generator" in err
    assert main(["report", str(tmp_path), "--generator", ruler.GENERATOR]) == 0
    text = (tmp_path / "report.md").read_text()
    assert f"Samples: `{ruler.GENERATOR}`" in text and "| quest | 10% | vt | 4096 | 2 | 0.0 (0–66) |" in text
    assert main(["report", str(tmp_path), "--generator", "ruler-0000000"]) == 2
    assert "no RULER records of 'ruler-0000000'" in capsys.readouterr().err


def test_oa_eval_will_not_add_cells_to_another_generators_folder(tmp_path, monkeypatch):
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _generator_records(None)))
    monkeypatch.setattr("oa_core.analysis.offline_model.load_offline_model", _no_model)
    with pytest.raises(ValueError, match=f"holds RULER records of the generator {eval_records.LEGACY_GENERATOR}"):
        runner.run(_config(tmp_path, tasks=["vt"]))


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the folder was checked")


def test_a_reader_that_leaves_ends_the_command_quietly(tmp_path, monkeypatch):
    """`oa report DIR | head -1`: the pipe's reader gone, the rest of the output goes nowhere, no traceback."""
    from oa_core.cli import main

    records = [
        dict(
            spec="dense",
            density=None,
            task="vt",
            length=4096,
            sample=0,
            score=50.0,
            answer_logprob=-2.0,
            measured_density=1.0,
        )
    ]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    read, write = os.pipe()
    os.close(read)  # the reader has left
    with os.fdopen(write, "w", buffering=1) as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        assert main(["report", str(tmp_path)]) == 141


def test_a_method_that_covers_fewer_tasks_than_dense_says_so_in_the_plot(tmp_path, monkeypatch):
    from oa_core.eval import report

    labels = []
    monkeypatch.setattr(report, "_pyplot", lambda: _recording_pyplot(labels))
    means = [
        {"spec": "dense", "density": 1.0, "tasks": 3, "retention": 1.0},
        {"spec": "quest", "density": 0.1, "tasks": 3, "retention": 0.9},
        {"spec": "quest", "density": 0.01, "tasks": 2, "retention": 0.5},
        {"spec": "openattention", "density": 0.1, "tasks": 3, "retention": 1.0},
    ]
    report.plot_accuracy_vs_density(means, tmp_path / "plot.png")
    assert "quest (2 of 3 tasks)" in labels and "openattention" in labels
    assert labels[-1] == "openattention"  # drawn last: on top of a line it coincides with


def _recording_pyplot(labels):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    class Recording:
        def __getattr__(self, name):
            return getattr(plt, name)

        def subplots(self, *args, **kwargs):
            fig, axes = plt.subplots(*args, **kwargs)
            for ax in axes.flat:
                plot = ax.plot
                ax.plot = lambda *a, _plot=plot, **k: (labels.append(k.get("label")), _plot(*a, **k))[1]
            return fig, axes

    return Recording()


def test_a_method_keeps_its_colour_with_or_without_ablations():
    from oa_core.eval.report import _colors

    methods = ["dense", "magicpig", "openattention", "oracle-topk", "quest"]
    alone = _colors(methods)
    beside = _colors([*methods, "ablate-tail-discard", "ablate-clusterer-kmeans"])
    assert "dense" not in alone and {m: beside[m] for m in alone} == alone
    assert len(set(beside.values())) == len(beside)  # every spec told apart, ablations from their own palette


def test_report_of_a_real_run(uninterrupted):
    from oa_core.eval.report import build_report

    out, _ = uninterrupted
    text = build_report(out).read_text()
    # A random model scores 0 dense: every task is one it cannot do, and no retention is claimed.
    assert "niah_single_1 (1024), vt (1024)" in text and "retention cannot be measured" in text
    # What each selection reads per key, at the model's head size D = 16 (a dense row: 2·D·2 = 64 bytes): exact
    # top-k scores from the whole key (2·D bytes), the default re-ranks 4 × 10% of the keys (4 · 0.1 · 2·D bytes).
    assert "| oracle-topk | 10% | 16 | 32 | 0 | 64 |" in text
    assert re.search(r"\| openattention \| 10% \| 16 \| [0-9.]+ \| 12.8 \| 64 \|", text)
    assert _colored_fraction(out / "per_task.png") > 0 and _colored_fraction(out / "accuracy_vs_density.png") > 0


def test_attention_error_shares_the_runner_and_its_records(model, tokenizer, tmp_path):
    """``--metric attention-error``: units are layers, cells specs × densities, the same records and summary, and
    a rerun resumes; the dense reference's error is ~0 and a sparse spec's is not."""
    config = _config(tmp_path, metric="attention-error", lengths=[300], layers=[0, 1], decode=4, diagnostics=True)
    rows = runner.run(config, model, tokenizer)
    records = eval_records.read_records(tmp_path)
    assert len(records) == 2 * (1 + 2) and {r["task"] for r in records} == {"attention-error"}
    assert {r["sample"] for r in records} == {0, 1}  # one unit per layer
    by_spec = {r["spec"]: r for r in rows}
    assert by_spec["dense"]["score"] < 1e-5 and by_spec["openattention"]["score"] > 1e-4
    assert all(math.isnan(r["retention"]) for r in rows)
    table = eval_records.summary_table(rows)  # relative errors printed as such, not rounded to a score's 0.0
    assert f"| {by_spec['openattention']['score']:.4f} |" in table
    sparse = [r for r in records if r["spec"] == "openattention"]
    assert all(0 <= r["top32_recall"] <= 1 and r["weight_discrepancy"] > 0 for r in sparse)  # --diagnostics
    assert not any("diagnostics" in r for r in records)  # written as fields of their own, once
    assert _comparable(runner.run(config, model, tokenizer)) == _comparable(rows)  # nothing left to run
    assert len(eval_records.read_records(tmp_path)) == 6
    from oa_core.eval.report import build_report

    text = build_report(tmp_path).read_text()
    assert "## Attention error on the model's own caches" in text and (tmp_path / "error_vs_density.png").is_file()


def test_a_batch_answers_as_its_samples_alone(model, tokenizer, tmp_path):
    """``batch``: samples with one question length decoded together, contexts left-padded. Dense and oracle top-k
    (no random draws) give each sample the log-likelihood and output it gets alone; a sparse spec reads its budget."""
    from oa_core.eval import ruler

    samples = ruler.generate("niah_multikey_2", tokenizer, 512, 6)  # needle lines: contexts of different lengths
    questions = [len(runner.encode(tokenizer, s.question)) for s in samples]
    batches = runner.sample_batches(questions, 4)
    assert sorted(i for b in batches for i in b) == list(range(6)) and all(len(b) <= 4 for b in batches)
    assert all(len({questions[i] for i in b}) == 1 for b in batches)
    together = [b for b in batches if len(b) > 1]
    assert together, "the test needs two samples with one question length"
    contexts = {len(runner.encode(tokenizer, samples[i].context)) for i in together[0]}
    assert len(contexts) > 1, "the test needs contexts of different lengths (padding)"

    config = dict(
        specs=["specs/oracle-topk.yaml", "specs/openattention.yaml"],
        tasks=["niah_multikey_2"],
        samples=6,
        lengths=[512],
    )
    runner.run(_config(tmp_path / "alone", **config), model, tokenizer)
    runner.run(_config(tmp_path / "batched", batch=4, **config), model, tokenizer)
    alone = {eval_records.record_key(r): r for r in eval_records.read_records(tmp_path / "alone")}
    batched = {eval_records.record_key(r): r for r in eval_records.read_records(tmp_path / "batched")}
    assert alone.keys() == batched.keys()
    for key, r in batched.items():
        assert r["batch"] == next(len(b) for b in batches if r["sample"] in b)
        if r["spec"] in ("dense", "oracle-topk"):
            assert r["answer_logprob"] == pytest.approx(alone[key]["answer_logprob"], abs=1e-3)
            assert r["output"] == alone[key]["output"]
        else:
            assert r["measured_density"] < 1.0


def test_sink_and_local_are_the_specs_own_unless_overridden(tmp_path):
    """Without sink=/local= each spec keeps its own (the YAML's local 64); a budget below them is refused, naming the
    spec, before any model loads (no model is passed here: a load would fail the test)."""
    config = _config(tmp_path, sink=None, local=None, lengths=[512])
    specs = runner.resolved_specs(config)
    assert all(data.get("local", 64) == 64 for data, dense in specs.values() if not dense)
    with pytest.raises(
        oa.SpecError,
        match=r"budget: .* at 10% of 512 tokens reads 51 rows, fewer than its sink \+ "
        r"local = 4 \+ 64",
    ):
        runner.run(config)
    overridden = runner.resolved_specs(_config(tmp_path, sink=2, local=8))
    assert all(data["sink"] == 2 and data["local"] == 8 for data, dense in overridden.values() if not dense)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Triton Error [CUDA]: out of memory"),
        getattr(torch, "AcceleratorError", RuntimeError)(
            "CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation'"
        ),
    ],
    ids=["triton-driver", "cuda-runtime"],
)
def test_the_driver_or_runtime_running_out_of_memory_is_retried_and_other_errors_are_raised(error):
    """Ranks sharing a GPU see its out-of-memory outside torch's allocator too: Triton reports the driver's as a
    RuntimeError ("Triton Error [CUDA]: out of memory") when no room is left to load a kernel, and under CUDA MPS torch
    raises the runtime's as ``torch.AcceleratorError`` ("CUDA error: out of memory"). Both are retried like torch's;
    any other RuntimeError is raised."""

    class Stats:
        resets = 0

        def reset_stats(self):
            self.resets += 1

    tries, stats, cpu = [], Stats(), torch.device("cpu")

    def loads_the_second_time():
        tries.append(1)
        if len(tries) == 1:
            raise error
        return "answered"

    assert memory.retry_after_oom(loads_the_second_time, stats, cpu) == "answered"
    assert len(tries) == 2 and stats.resets == 1

    def wrong_shape():
        raise RuntimeError("shape '[4, 16]' is invalid for input of size 60")

    with pytest.raises(RuntimeError, match="is invalid for input"):
        memory.retry_after_oom(wrong_shape, stats, cpu)
    assert stats.resets == 1


@pytest.mark.parametrize(("lengths", "past"), [((4096,), None), ((4096, 8192, 16384), "8,192, 16,384")])
def test_lengths_that_fill_the_models_positions_are_warned_of(lengths, past):
    from transformers import LlamaConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.warn_past_positions(LlamaConfig(max_position_embeddings=8192), lengths)  # SmolLM2-135M's
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    expected = f"lengths {past}: prompts that long leave the answer past the 8,192 positions the model was trained on"
    assert [m[: len(expected)] for m in messages] == ([expected] if past else [])
