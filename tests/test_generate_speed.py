"""benchmarks/generate_speed.py's JSON: dense-fastest is the faster dense static-cache decode of the same run, each
OpenAttention run is held to the issue's target for its spec, GQA mode, density and configuration (a miss says by how
much), and runs made in separate processes merge into one result."""

from pathlib import Path

import pytest

from conftest import load_benchmark

DEFAULT, PAPER = "specs/openattention.yaml", "specs/openattention-paper.yaml"


def run(method, ms, density=None, batch=16, context=16384, prefill=1.0, prepare=None, spec=None, gqa=None):
    return {
        "batch": batch,
        "context": context,
        "method": method,
        "density": density,
        "spec": spec,
        "gqa": gqa,
        "per_token_ms": ms,
        "prefill_s": prefill,
        "prepare_s": prepare,
        "tokens": 4,
    }


def test_dense_fastest_and_the_targets(tmp_path):
    bench = load_benchmark("generate_speed")
    runs = [
        run("dense-default", 9.0),
        run("dense-static", 6.0),
        run("dense-engine", 5.0),
        run("no-attention", 2.0),
        run("openattention", 2.5, 0.01, prefill=1.1, prepare=0.1, spec=DEFAULT, gqa="per_head"),
        run("openattention", 4.0, 0.03, prefill=1.3, prepare=0.3, spec=DEFAULT, gqa="per_head"),
        run("openattention", 5.0, 0.01, spec=DEFAULT, gqa="shared"),  # no target: reported only
        run("openattention", 2.0, 0.01, spec=PAPER, gqa="shared"),
        run("dense-static", 8.0, context=131072, batch=2),
        run("dense-engine", 10.0, context=131072, batch=2),
        run("openattention", 4.0, 0.01, context=131072, batch=2, spec=DEFAULT, gqa="per_head"),
        run("openattention", None, 0.03, context=131072, batch=2, spec=DEFAULT, gqa="per_head"),  # out of memory
    ]
    out = bench.summary({"device": "x"}, runs)
    fastest = [r for r in out["runs"] if r["method"] == "dense-fastest"]
    assert [(r["context"], r["per_token_ms"], r["derived_from"]) for r in fastest] == [
        (16384, 5.0, "dense-engine"),
        (131072, 8.0, "dense-static"),
    ]
    assert out["runs"][: len(runs)] == runs  # the measured runs unchanged
    speed = {
        (t["context"], t["spec"], t["gqa"], t["density"]): t
        for t in out["targets"]
        if "speedup_over_dense_fastest" in t
    }
    assert len(speed) == 5  # the failed run has no ratio
    hit = speed[(16384, DEFAULT, "per_head", 0.01)]  # 2× against 1.5×
    assert hit["met"] and hit["speedup_over_dense_fastest"] == 2.0 and hit["target"] == 1.5 and hit["short_by"] == 0
    miss = speed[(16384, DEFAULT, "per_head", 0.03)]  # 1.25× against 1.3×
    assert not miss["met"] and miss["target"] == 1.3 and miss["short_by"] == 0.05
    assert speed[(16384, DEFAULT, "shared", 0.01)]["target"] is None
    assert speed[(16384, DEFAULT, "shared", 0.01)]["met"] is None
    assert speed[(16384, PAPER, "shared", 0.01)]["target"] == 2.0 and speed[(16384, PAPER, "shared", 0.01)]["met"]
    long = speed[(131072, DEFAULT, "per_head", 0.01)]  # 2× against 2.5× at 2 × 128K
    assert long["target"] == 2.5 and not long["met"] and long["short_by"] == 0.5
    # Prepare over the model's prefill in the same run (its time to the first token less the prepare): 0.1 s of
    # 1.1 s meets 10%, 0.3 s of 1.3 s is 30%.
    prepare = {t["density"]: t for t in out["targets"] if "prepare_over_prefill" in t}
    assert prepare[0.01]["prepare_over_prefill"] == 0.1 and prepare[0.01]["met"]
    assert prepare[0.03]["prepare_over_prefill"] == 0.3 and not prepare[0.03]["met"]
    assert prepare[0.03]["short_by"] == 0.2 and len(prepare) == 2
    row = "| 16 × 16384 | openattention | openattention, per_head | 1% | 2.50 | 2.00× | 1.10 | 0.10 | 10.0% |"
    assert row in bench.table(out["runs"])
    figure = bench.plot(out["runs"], tmp_path / "speed.png")
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_of_separate_processes_combine():
    """Each process saves its own result; combined, the runs keep their order, a run saved twice (configuration,
    method, spec, GQA mode and density) keeps the later one, dense-fastest is derived again, and results from
    different devices are refused."""
    bench = load_benchmark("generate_speed")

    def saved(device, commit, *runs):
        return {**bench.summary({"device": device, "variants": {}}, list(runs)), "provenance": {"commit": commit}}

    first = saved("gpu", "a", run("dense-engine", 5.0), run("openattention", 2.0, 0.01, spec=PAPER, gqa="shared"))
    second = saved("gpu", "a", run("dense-engine", 9.0, batch=2), run("dense-static", 8.0, batch=2))
    again = saved("gpu", "b", run("dense-engine", 4.0))
    out = bench.combine([first, second, again])
    measured = [(r["batch"], r["method"], r["per_token_ms"]) for r in out["runs"] if r["method"] != "dense-fastest"]
    paper_kept = (16, "openattention", 2.0)  # 16 × 16K saved again without this run: it stays
    assert measured == [
        paper_kept,
        (2, "dense-engine", 9.0),
        (2, "dense-static", 8.0),
        (16, "dense-engine", 4.0),
    ]
    fastest = {r["batch"]: r["per_token_ms"] for r in out["runs"] if r["method"] == "dense-fastest"}
    assert fastest == {2: 8.0, 16: 4.0}
    assert out["provenance_by_config"] == {"16x16384": {"commit": "b"}, "2x16384": {"commit": "a"}}
    assert "provenance_by_config" not in bench.combine([first, second])
    # A saved combination combined again keeps each of its configurations' own provenance, not its last one's.
    later = saved("gpu", "c", run("dense-engine", 3.0, batch=4))
    assert bench.combine([out, later])["provenance_by_config"] == {
        "16x16384": {"commit": "b"},
        "2x16384": {"commit": "a"},
        "4x16384": {"commit": "c"},
    }
    with pytest.raises(ValueError, match="different devices"):
        bench.combine([first, saved("cpu", "a", run("dense-engine", 5.0))])


def test_each_method_runs_in_its_own_process_and_kept_ones_are_not_run_again(tmp_path, monkeypatch):
    """Each configuration × method (each variant apart) is a child process with only that method; with ``--keep DIR``
    it writes DIR/<config>/<method>.json, one already there is not run again, one whose child fails has what it
    measured merged but runs again next time, and the merge holds them all."""
    import json
    import subprocess

    bench = load_benchmark("generate_speed")
    keep, out, started = tmp_path / "parts", tmp_path / "speed.json", []

    def child(command, failing=()):
        config, partial = command[command.index("--configs") + 1], Path(command[command.index("--out") + 1])
        methods = command[command.index("--methods") + 1 : command.index("--configs")]
        batch, context = map(int, config.split("x"))
        if methods[0] == "openattention":
            variant = methods[methods.index("--variants") + 1]
            made = run("openattention", 2.0, 0.01, batch=batch, context=context, spec=variant, gqa="shared")
        else:
            made = run(methods[0], 5.0, batch=batch, context=context)
        started.append((config, methods[0]))
        saved = bench.summary({"device": "gpu", "variants": {}}, [made])
        partial.write_text(json.dumps({**saved, "provenance": {"commit": "a"}}))
        return subprocess.CompletedProcess(command, 1 if (config, methods[0]) in failing else 0)

    (keep / "2x16384").mkdir(parents=True)
    earlier = [
        "--methods",
        "dense-engine",
        "--configs",
        "2x16384",
        "--out",
        str(keep / "2x16384" / "dense-engine.json"),
    ]
    child(earlier)
    started.clear()
    monkeypatch.setattr(subprocess, "run", lambda command: child(command, failing={("8x32768", "openattention")}))
    argv = ["--configs", "2x16384", "8x32768", "--methods", "dense-engine", "openattention", "--variants", PAPER]
    argv += ["--keep", str(keep), "--out", str(out), "--device", "cpu"]
    assert bench.main(argv) == 1  # 8x32768's openattention child failed
    assert started == [("2x16384", "openattention"), ("8x32768", "dense-engine"), ("8x32768", "openattention")]
    kept = sorted(str(p.relative_to(keep)) for p in keep.rglob("*.json"))
    paper = "specs_openattention-paper.json"
    assert kept == ["2x16384/dense-engine.json", f"2x16384/{paper}", "8x32768/dense-engine.json"]
    merged = {(r["batch"], r["method"]) for r in json.loads(out.read_text())["runs"] if r["method"] != "dense-fastest"}
    assert merged == {(2, "dense-engine"), (2, "openattention"), (8, "dense-engine"), (8, "openattention")}
    started.clear()
    monkeypatch.setattr(subprocess, "run", child)
    assert bench.main(argv) == 0 and started == [("8x32768", "openattention")]
    assert (keep / "8x32768" / paper).is_file() and not (keep / "8x32768" / paper).with_suffix(".partial").exists()


def test_combine_names_what_it_cannot_read(tmp_path, capsys):
    bench = load_benchmark("generate_speed")
    with pytest.raises(SystemExit) as refused:
        bench.main(["--combine", str(tmp_path / "none.json"), "--out", str(tmp_path / "out.json")])
    assert refused.value.code == 2 and "--combine" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_variants_and_configs_are_checked_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    """``--variants``: a missing file, a bad GQA mode or a spec naming a bad parameter, and a malformed --configs,
    end in a clear error with no model built; a good variant's components, with its GQA mode over the file's, are
    what the OpenAttention runs patch in."""
    bench = load_benchmark("generate_speed")
    built, real_build = [], bench.build_model

    def build_model(*args):
        built.append(args)
        raise SystemExit(3)  # stop here: the arguments were accepted

    monkeypatch.setattr(bench, "build_model", build_model)
    path = tmp_path / "spec.yaml"
    path.write_text("selector: {name: qgs, rerank: -1}\n")
    for argv, message in [
        (["--variants", str(tmp_path / "none.yaml")], "no file"),
        (["--variants", f"{path}:both"], "per_head or shared"),
        (["--variants", str(path)], "rerank"),
        (["--configs", "16by16384"], "BATCHxCONTEXT"),
    ]:
        with pytest.raises(SystemExit) as refused:
            bench.main([*argv, "--device", "cpu"])
        assert refused.value.code == 2 and message in capsys.readouterr().err
    assert not built
    path.write_text("selector: {name: qgs, rerank: 4}\nallocator: {name: errorgate, floor: 0.5}\ngqa: per_head\n")
    patched = []
    monkeypatch.setattr(bench, "warm_prepare", lambda model, ids, spec, density: patched.append(spec))
    monkeypatch.setattr(bench, "build_model", real_build)
    monkeypatch.setattr(bench, "run_method", lambda model, ids, method, density, spec, args: {"per_token_ms": None})
    monkeypatch.setattr(bench, "summary", lambda machine, runs: {"machine": machine, "runs": runs})
    monkeypatch.setattr(bench, "write", lambda out, result, quiet=False, figure=True: patched.append(result) or 0)
    argv = ["--variants", f"{path}:shared", "--device", "cpu", "--configs", "1x8", "--methods", "openattention"]
    bench.main([*argv, "--tiny", "--layers", "1"])
    assert len(built) == 0 and patched[0]["gqa"] == "shared" and patched[0]["selector"]["params"]["rerank"] == 4
    assert patched[0]["allocator"]["params"]["floor"] == 0.5
    runs = patched[-1]["runs"]
    assert [(r["spec"], r["gqa"], r["density"]) for r in runs] == [
        (f"{path}", "shared", 0.01),
        (f"{path}", "shared", 0.03),
    ]
