"""Where the Triton fast paths run: on CUDA tensors, and on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set before any kernel is defined, as the test suite does). Elsewhere each component runs its
torch reference and, where it reports one, says why.

The one guarded import of Triton: modules with kernels take ``triton``, ``tl`` and ``libdevice`` from here (None
without Triton) and define their kernels under ``if triton is not None``."""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = tl = None


def _find_libdevice() -> Any:
    try:
        from triton.language.extra import libdevice
    except ImportError:  # pragma: no cover - older triton
        try:
            from triton.language.extra.cuda import libdevice
        except ImportError:
            return None
    return libdevice


# CUDA's libdevice math (e.g. the exp torch uses on CUDA), where this Triton has it
libdevice: Any = _find_libdevice() if triton is not None else None


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


def tensor_core_dots(dtype: torch.dtype) -> bool:
    """Whether kernels take tensor-core dots of 16-bit inputs (float32 accumulation) for ``dtype``: float16 and
    bfloat16, but not bfloat16 in the interpreter, whose ``tl.dot`` multiplies bfloat16 tiles wrongly (those inputs
    are then upcast to float32 first)."""
    return dtype == torch.float16 or (dtype == torch.bfloat16 and not interpreting())
