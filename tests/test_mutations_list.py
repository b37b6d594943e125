"""The seeded bugs of ``benchmarks/mutations.py`` still apply to the code as it is: each edit of each mutation finds
its text exactly once in its file (after the mutation's earlier edits). A refactor that moves or rewrites a mutated
line fails here, in CI, instead of leaving a mutation that cannot run and an old "caught" in mutations.json."""

from pathlib import Path

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _mutations():
    return load_benchmark("mutations").MUTATIONS


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


def test_a_partial_run_replaces_its_rows_and_counts_each_row_s_commit():
    def row(name, caught, commit=None):
        return {"name": name, "caught": caught, **({"commit": commit} if commit else {})}

    previous = {"commit": "old", "mutations": [row("a", True), row("b", False), row("gone", True)]}
    run = {"commit": "new1234567", "seconds": 3.0, "mutations": [row("b", True, "new1234")]}
    merged = load_benchmark("mutations").merged(previous, run, listed={"a", "b"})
    assert [(r["name"], r["caught"], r["commit"]) for r in merged["mutations"]] == [
        ("a", True, None),
        ("b", True, "new1234"),
    ]
    assert (merged["caught"], merged["total"], merged["commit"], merged["seconds"]) == (2, 2, "new1234567", 3.0)
    assert merged["commits"] == {"unrecorded": 1, "new1234": 1}
