"""The suite's quicker Triton interpreter (``tests/conftest.py``): the built-ins it swaps at a launch are the ones
Triton's own ``_patch_builtin`` swaps, on every module the interpreter patches."""

import pytest

import conftest


def test_the_listed_built_ins_are_the_ones_triton_patches():
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    import triton.language as tl

    if conftest.TRITONS_PATCH_BUILTIN is None:
        pytest.skip("Triton's interpreter is laid out otherwise (or not interpreting): the suite left it as it is")
    for pkg in (tl, tl.core, tl.tensor, tl.math):
        swapped = []
        for patch in (interpreter._patch_builtin, conftest.TRITONS_PATCH_BUILTIN):
            scope = interpreter._LangPatchScope()
            patch(pkg, None, scope)
            swapped.append([(name, original) for _, name, original in scope._changes])
            scope.restore()
        assert swapped[0] == swapped[1] and swapped[0], pkg.__name__
