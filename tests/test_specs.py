"""Every ready spec in specs/ (issue: baselines and ablations), and the diagnosis specs of
benchmarks/studies/diagnosis/, builds, runs and stays within its budget."""

from pathlib import Path

import pytest
import torch

import oa_core as oa
from conftest import make_inputs
from oa_core.cli import main as oa_main

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(ROOT.glob("specs/*.yaml")) + sorted(ROOT.glob("benchmarks/studies/diagnosis/*.yaml"))
EXPECTED = {
    "dense",
    "oracle-topk",
    "quest",
    "magicpig",
    "vattention",
    "retroinfer",
    "openattention",
    "ablate-clusterer-kmeans",
    "ablate-clusterer-position",
    "ablate-selector-oracle",
    "ablate-selector-lsh",
    "ablate-allocator-mass",
    "ablate-allocator-variance",
    "ablate-allocator-uniform",
    "ablate-tail-discard",
    "ablate-tail-sample",
}


def test_every_method_and_ablation_has_a_spec_with_a_header():
    assert {path.stem for path in SPECS} >= EXPECTED
    for path in SPECS:
        header = [line for line in path.read_text().splitlines() if line.startswith("#")]
        assert header and path.read_text().startswith("#"), f"{path.name}: no header comment"


def test_oa_validate_accepts_every_spec(capsys):
    assert oa_main(["validate", *map(str, SPECS)]) == 0
    assert capsys.readouterr().out.count(": ok:") == len(SPECS)


@pytest.fixture(scope="module")
def long_inputs():
    # Long enough that 3% of the context exceeds the specs' sink + local (4 + 64): N = 2560 gives 76 rows.
    keys, values, prefill, decode = make_inputs(batch=2, kv_heads=2, group=4, tokens=2560, dim=32, queries=2, seed=11)
    mask = torch.ones(2, 2560, dtype=torch.bool)
    mask[1, :60] = False  # the second row is left-padded
    return keys, values, prefill, decode, mask


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_spec_runs_with_gqa_and_batch_within_its_budget(path, long_inputs):
    keys, values, prefill, decode, mask = long_inputs
    pipe = oa.build(path)
    state = pipe.prepare(keys, values, prefill, mask=mask)
    out, stats = pipe.attend(decode, state, return_stats=True)
    assert out.shape == decode.shape and bool(torch.isfinite(out).all())
    lengths = mask.sum(-1)
    budget = pipe.spec.budget.rows(lengths).clamp_max(lengths)  # [B]
    assert bool((stats.reads <= budget.view(-1, 1, 1, 1)).all()), path.stem
    assert bool((stats.reads >= pipe.spec.sink + pipe.spec.local).all())  # sink and local are always read
    if pipe.spec.budget.density == 1.0:
        assert stats.dense and stats.reason.startswith("dense")
    else:
        assert not stats.dense and stats.density <= pipe.spec.budget.density
    # Decode-time growth keeps working.
    state.append(keys[:, :, :3], values[:, :, :3])
    assert bool(torch.isfinite(pipe.attend(decode, state)).all())
