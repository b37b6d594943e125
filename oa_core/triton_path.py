"""Where the Triton fast paths run: on CUDA tensors, and on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set before any kernel is defined, as the test suite does). Elsewhere each component runs its
torch reference and, where it reports one, says why."""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (on the CPU, in Python: slow, for tests at small shapes)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton path can't run on tensors of ``device`` (None: it can)."""
    if triton is None:
        return "triton is not installed"
    if device.type == "cuda" or (interpreting() and device.type == "cpu"):
        return None
    return f"no CUDA device for tensors on {device} (set TRITON_INTERPRET=1 to run the kernels on the CPU)"
