"""The seeded bugs of ``benchmarks/mutations.py`` still apply to the code as it is: each edit of each mutation finds
its text exactly once in its file (after the mutation's earlier edits). A refactor that moves or rewrites a mutated
line fails here, in CI, instead of leaving a mutation that cannot run and an old "caught" in mutations.json."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutations():
    spec = importlib.util.spec_from_file_location("oa_mutations", ROOT / "benchmarks" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.MUTATIONS


def test_every_mutation_applies_to_the_current_code():
    stale = []
    for m in _mutations():
        text = (ROOT / m.file).read_text()
        for old, new in m.edits:
            if text.count(old) != 1:
                stale.append(f"{m.name}: {old!r} occurs {text.count(old)} times in {m.file}")
                break
            text = text.replace(old, new)
    assert not stale, "update benchmarks/mutations.py:\n" + "\n".join(stale)


def test_mutation_names_are_unique_and_name_existing_tests():
    mutations = _mutations()
    names = [m.name for m in mutations]
    assert len(names) == len(set(names))
    for m in mutations:
        for test in m.tests:
            assert (ROOT / test.split("::")[0]).is_file(), f"{m.name}: {test} does not exist"
