"""benchmarks/fused_step_sweep.py: its random configurations span what its docstring names, one runs through the fused
step and the reference under the interpreter, and a step whose rows differ is reported, not hidden."""

import json

import pytest

import oa_core as oa
from conftest import load_benchmark
from oa_core.testing import fused

sweep = load_benchmark("fused_step_sweep")


def test_the_configurations_are_seeded_and_span_the_space():
    drawn = [sweep.draw(seed) for seed in range(400)]
    assert drawn[7] == sweep.draw(7)
    inputs = [d["inputs"] for d in drawn]
    specs = [d["spec"] for d in drawn]
    assert {i["group"] for i in inputs} == {1, 2, 3, 4, 8}
    assert {i["dim"] for i in inputs} == {16, 32, 64, 80, 96, 128}
    assert {i["dtype"] for i in inputs} == {"float32", "bfloat16", "float16"}
    assert {s["selector"]["name"] for s in specs} == {"pq", "qgs"}
    pq = [s["selector"] for s in specs if s["selector"]["name"] == "pq" and "dims" in s["selector"]]
    assert {(p["dims"], p["bits"]) for p in pq} == {(d, b) for d in (1, 2, 4) for b in (4, 8)}
    assert {s["selector"].get("rank") for s in specs if s["selector"]["name"] == "qgs"} == {4, 8, 16}
    assert {(s["gqa"], s["tail"], s["proxy"]) for s in specs} >= {
        (gqa, tail, proxy)
        for gqa in ("per_head", "shared")
        for tail in ("proxy", "discard")
        for proxy in ("mean", "second-order")
    }
    assert any("tokens" in s["budget"] for s in specs) and any(s["allocator"]["floor"] for s in specs)
    for spec in specs:  # every drawn spec is one the library accepts (the floor never above the re-rank)
        oa.load_spec(spec)


@pytest.fixture
def flash():
    if "flash" not in oa.available()["kernel"]:
        pytest.skip("no flash kernel (Triton)")


# A configuration of the default's kind (PQS re-ranked 4×, ErrorGate's floor) that decodes in seconds.
FAST_SEED = 47


def test_a_configuration_decodes_through_both_and_is_written(flash, tmp_path):
    out = tmp_path / "sweep.json"
    assert sweep.main(["--configs", "1", "--seed", str(FAST_SEED), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (config,) = report["configs"]
    assert config["spec"]["selector"] == {"name": "pq", "rerank": 4} and config["outcome"] == "same"
    assert config["same_layout_as_composed"] and config["relative_error"] < 1e-2
    assert report["summary"]["all_same"] and report["triton_interpreter"]


def test_a_step_that_reads_other_rows_is_reported(flash, monkeypatch, tmp_path):
    real = fused.decode_side_by_side

    def one_row_off(*args, **kwargs):
        records, composed, state = real(*args, **kwargs)
        records[-1].rows[0] = records[-1].rows[0][1:]  # the last step's first row misses one row
        return records, composed, state

    monkeypatch.setattr(fused, "decode_side_by_side", one_row_off)
    out = tmp_path / "sweep.json"
    assert sweep.main(["--configs", "1", "--seed", str(FAST_SEED), "--out", str(out)]) == 1
    (config,) = json.loads(out.read_text())["configs"]
    steps = sweep.draw(FAST_SEED)["inputs"]["steps"]
    assert config["outcome"] == "differs" and config["steps_with_other_rows"] == [steps - 1]
