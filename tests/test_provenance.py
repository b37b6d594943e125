"""What made a result: ``oa_core.analysis.provenance`` (the commit and the machine, recorded by ``oa eval``,
``oa demo --out`` and the headline benchmarks) and how ``benchmarks/results_tables.py`` reads it back, from the
result's own fields or, for a result from before, from its device fields and git."""

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import load_benchmark
from oa_core.analysis import demo
from oa_core.analysis.provenance import CHECKOUT, provenance

ROOT = Path(__file__).resolve().parents[1]


def test_the_checkout_s_commit_and_the_cpu():
    made = provenance("cpu")
    assert set(made) == {"commit", "dirty", "machine"} and made["machine"].endswith(" cores")
    if (CHECKOUT / ".git").exists() and shutil.which("git"):
        head = subprocess.run(
            ["git", "-C", str(CHECKOUT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert made["commit"] == head and isinstance(made["dirty"], bool)


def test_a_stated_commit_names_a_copied_checkout_s_code(monkeypatch, tmp_path):
    """A copy of the working tree on another machine keeps an older ``.git``: ``$OA_COMMIT`` names its commit (the
    copy is clean by the caller's word), and anything but a hash is refused."""
    monkeypatch.setenv("OA_COMMIT", "4983d7b1c0ffee")
    assert provenance(root=tmp_path) == {"commit": "4983d7b", "dirty": False, "machine": provenance()["machine"]}
    monkeypatch.setenv("OA_COMMIT", "HEAD")
    with pytest.raises(ValueError, match="OA_COMMIT: expected a commit's hash"):
        provenance()


def test_without_a_repository_the_commit_is_none_not_an_error(tmp_path):
    assert provenance(root=tmp_path) == {"commit": None, "dirty": None, "machine": provenance()["machine"]}


def test_oa_demo_out_records_its_provenance(tmp_path, monkeypatch):
    """``oa demo --out`` writes the commit and the machine beside what it printed (the model and the run faked)."""
    lm = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2), device=torch.device("cpu"))
    monkeypatch.setattr(demo, "check_demo", lambda tokens, density: None)
    monkeypatch.setattr(demo, "load_offline_model", lambda model: (lm, None))
    monkeypatch.setattr(
        demo.needle,
        "make_samples",
        lambda *a, **k: [SimpleNamespace(answer="123", depth=0.5, context_ids=torch.zeros(1, 300, dtype=torch.long))],
    )
    monkeypatch.setattr(
        demo.needle,
        "run",
        lambda lm, tokenizer, samples, specs: [
            {
                "spec": name,
                "density": 1.0,
                "answer_logprob": -1.0,
                "correct": True,
                "output": "123.",
                "prepare_s": 0.1,
                "sparse_attend_s": 0.1,
                "prefill_s": 0.1,
            }
            for name in specs
        ],
    )
    assert demo.run_demo(tokens=300, out=tmp_path / "demo.json") == 0
    written = json.loads((tmp_path / "demo.json").read_text())
    assert written["provenance"] == provenance("cpu")


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """results_tables reading a results folder of the test's own, git's answers given by the test."""
    tables = load_benchmark("results_tables")
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    answers = {"rev-parse": "abc1234", "status": "", "log": "def5678"}
    monkeypatch.setattr(tables, "git", lambda *args, root: answers[args[0]])
    tables.answers = answers
    return tables


def test_a_result_s_own_provenance_comes_first(tables, tmp_path):
    (tmp_path / "new.json").write_text(
        json.dumps(
            {
                "machine": {"gpu": "an older field"},
                "provenance": {"commit": "0123456789", "dirty": True, "machine": "NVIDIA H100 80GB HBM3"},
            }
        )
    )
    made = tables.made_by(tmp_path / "new.json")
    assert made.short() == "H100; commit 0123456 with uncommitted changes"  # a GPU by its model, as records files


def test_runs_merged_from_several_commits_name_each_configuration_s(tables, tmp_path):
    h100 = "NVIDIA H100 80GB HBM3"
    made = {
        config: {"commit": commit, "dirty": False, "machine": h100}
        for config, commit in (("16x16384", "aaaaaaa1"), ("8x32768", "aaaaaaa1"), ("2x131072", "bbbbbbb2"))
    }
    (tmp_path / "merged.json").write_text(
        json.dumps({"provenance": {"commit": "bbbbbbb2", "machine": h100}, "provenance_by_config": made})
    )
    made_by = tables.made_by(tmp_path / "merged.json")
    assert made_by.commit == "commit aaaaaaa (16x16384, 8x32768); commit bbbbbbb (2x131072)"
    assert made_by.how.endswith("commit: `provenance_by_config`")


def test_rows_merged_from_several_runs_count_each_commit(tables, tmp_path):
    record = {"machine": {"cpus": 2}, "commit": "ccccccc3", "commits": {"unrecorded": 5, "ccccccc3": 1}}
    (tmp_path / "mutations.json").write_text(json.dumps(record))
    made_by = tables.made_by(tmp_path / "mutations.json")
    assert made_by.commit == "unrecorded (5); commit ccccccc (1)"
    assert made_by.how.endswith("commit: `commits`")


def test_a_result_from_before_is_read_from_its_device_fields_and_git(tables, tmp_path):
    for name, result in {
        "gpu.json": {"machine": {"gpu": "NVIDIA H200"}},
        "device.json": {"device": "NVIDIA H200"},
        "cpu.json": {"machine": {"platform": "Linux", "cpus": 2}},
        "bare.json": {"what": "no device field"},
        "mutations.json": {"machine": {"cpus": 2}, "commit": "e195285fd89096c2"},
    }.items():
        (tmp_path / name).write_text(json.dumps(result))
    short = {
        name: tables.made_by(tmp_path / name).short()
        for name in ("gpu.json", "device.json", "cpu.json", "bare.json", "mutations.json")
    }
    assert short == {
        "gpu.json": "H200; committed in def5678",
        "device.json": "H200; committed in def5678",
        "cpu.json": "CPU (2 cores); committed in def5678",
        "bare.json": "not recorded; committed in def5678",
        "mutations.json": "CPU (2 cores); commit e195285",
    }
    tables.answers["status"] = " M cpu.json"  # differs from git's copy: its last commit did not make it
    assert tables.made_by(tmp_path / "cpu.json").commit == "uncommitted (HEAD abc1234)"
    tables.answers.update({"rev-parse": None, "log": None})  # no git, or no repository
    assert tables.made_by(tmp_path / "cpu.json").commit == "commit unknown"


def test_an_eval_folder_names_each_record_s_machine(tables, tmp_path):
    folder = tmp_path / "ruler"
    folder.mkdir()
    record = {"spec": "dense", "density": None}
    (folder / "records-h100.jsonl").write_text(json.dumps({**record, "device": "cuda:0"}) + "\n")
    (folder / "records-rank0.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {**record, "device": "cpu"},
                {**record, "device": "cuda:1"},
                {
                    **record,
                    "device": "cpu",
                    "provenance": {"commit": "7654321", "dirty": False, "machine": "Xeon, 2 cores"},
                },
                {  # the same GPU as records-h100.jsonl's, named by its provenance: one machine, not two
                    **record,
                    "device": "cuda:0",
                    "provenance": {"commit": "7654321", "dirty": False, "machine": "NVIDIA H100 80GB HBM3"},
                },
                {"spec": "quest", "density": 0.03, "device": "cpu"},
            ]
        )
        + "\n"
    )
    made = tables.made_by(folder, keep=lambda r: r["spec"] == "dense")
    assert made.machine == "H100 + CPU + a CUDA GPU + Xeon, 2 cores"
    assert made.commit == "commit 7654321, committed in def5678"
    assert "H100 2, CPU 1, a CUDA GPU 1, Xeon, 2 cores 1" in made.how and "2 records name 7654321" in made.how


def test_check_compares_the_figures_not_git_s_commits(tables):
    old = "| x | CPU; committed in def5678 |\nMade by: H200; uncommitted (HEAD abc1234)."
    new = "| x | CPU; committed in 9999999 |\nMade by: H200; committed in 1234567."
    assert tables.GIT_LABEL.sub("…", old) == tables.GIT_LABEL.sub("…", new)
    assert tables.GIT_LABEL.sub("…", old) != tables.GIT_LABEL.sub("…", new.replace("CPU", "GPU"))
