"""Every Triton kernel fits an sm_90 GPU (H100/H200) at head dims 64 to 256: compiled here, without a GPU, with the
block sizes its caller picks (``benchmarks/studies/kernel_resources.py``). At Gemma-3's head dim 256 the Lloyd step
asked for 384 KB of shared memory (the limit is 227 KB) and flash's pass spilled 18 KB a thread, which ran an H200
shared by ten processes out of memory; the interpreter the rest of the suite runs on sees neither."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "studies" / "kernel_resources.py"


def _nvidia_tools() -> bool:
    spec = importlib.util.find_spec("triton")
    return spec is not None and (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump").is_file()


@pytest.mark.skipif(not _nvidia_tools(), reason="Triton's NVIDIA backend (ptxas, cuobjdump) is not installed")
def test_every_kernel_fits_an_sm90_gpu_at_head_dims_64_to_256():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # compiled, not interpreted
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dims", "64", "128", "256"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.stdout, done.stderr
    report = json.loads(done.stdout)
    kernels = {(row["kernel"], row.get("dim")) for row in report["rows"]}
    assert {kernel for kernel, _ in kernels} == {
        "flash_programs.sparse_pass",
        "kmeans._lloyd_step",
        "kmeans._nearest",
        "kmeans._kmeans_plus_plus",
        "pq_shortlist_programs.pq_scores",
        "pq_shortlist_programs.pq_cut",
        "pq_shortlist_programs.pq_list",
        "flash_step_programs.prologue",
        "pq_programs._pq_encode",
        "pq_programs._pq_train",
        "plan_programs.plan",
        "selection._select_kernel",
    }
    too_big = [
        row for row in report["rows"] if row["shared"] > report["shared_limit"] or row["stack"] > report["stack_limit"]
    ]
    assert not too_big, json.dumps(too_big, indent=1)
    assert done.returncode == 0
