"""Which code and which machine made a result: recorded beside the figures by ``oa eval``, ``oa demo --out`` and the
headline benchmarks, so that a results page can say where each figure comes from.

``provenance(device)`` is ``{"commit", "dirty", "machine"}``:

- ``commit``: the short hash of the checkout ``oa_core`` runs from (``git rev-parse --short HEAD``), or None where
  there is none (an installed wheel) or git cannot say;
- ``dirty``: whether the code of that checkout — ``oa_core/``, ``plugins/``, ``specs/`` and the benchmark scripts,
  the result files aside — differs from the commit (None when ``commit`` is None);
- ``machine``: the GPU's name when ``device`` is a CUDA device, else the CPU's model and its cores.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[2]
# What `dirty` looks at: the code, not the results a run writes into the checkout.
CODE = [
    "oa_core",
    "plugins",
    "specs",
    "benchmarks",
    ":(exclude)benchmarks/results",
    ":(exclude)benchmarks/studies/results",
]


def git(*args: str, root: Path = CHECKOUT) -> str | None:
    """git's output in ``root``, stripped, or None without a repository there, without git, or on an error."""
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo, else what the platform says) and its logical cores."""
    name = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "CPU"
    return f"{name}, {os.cpu_count()} cores"


def machine(device: Any = None) -> str:
    """The GPU's name for a CUDA ``device`` (a torch.device or a string such as ``"cuda:1"``), else the CPU's."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return cpu_model()


COMMIT_ENV = "OA_COMMIT"  # the commit of a copied working tree whose git history is not its code's


def provenance(device: Any = None, root: Path = CHECKOUT) -> dict[str, Any]:
    """``{"commit": short hash or None, "dirty": bool or None, "machine": str}`` for a run on ``device``.

    ``$OA_COMMIT``, where set, names the commit instead of git: for a copy of a clean checkout on another machine
    whose ``.git`` is older than its files (a device that receives the working tree), the files are that commit's."""
    stated = os.environ.get(COMMIT_ENV, "").strip()
    if stated:
        if not re.fullmatch(r"[0-9a-f]{7,40}", stated):
            raise ValueError(f"{COMMIT_ENV}: expected a commit's hash (7 to 40 hex digits), got {stated!r}")
        return {"commit": stated[:7], "dirty": False, "machine": machine(device)}
    commit = git("rev-parse", "--short", "HEAD", root=root)
    changed = git("status", "--porcelain", "--untracked-files=no", "--", *CODE, root=root) if commit else None
    return {"commit": commit, "dirty": None if changed is None else bool(changed), "machine": machine(device)}
