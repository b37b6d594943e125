"""ErrorGate's floor in the fused step (``two_stage_programs.floor_counts``, the plan's): each selection row's best
⌊f·E_sel⌋ shortlist entries by exact logit, ties to the earlier entry (the shortlist is in position order), counted per
cluster — its radix select in one block and across blocks, against a stable sort in torch, on shortlists whose tied
entries lie in different clusters (where the order among ties changes the counts)."""

from __future__ import annotations

import pytest
import torch

from oa_core.ops.triton_path import tl, triton
from oa_plugins.kernels.two_stage_programs import floor_counts

pytestmark = pytest.mark.skipif(triton is None, reason="needs Triton (its interpreter on the CPU)")

if triton is not None:

    @triton.jit
    def _floor(
        ASSIGNMENT, LENGTH, START, DENSITY, FLOOR_SHARE, LISTED, COUNTS, EXACT, OUT, Hkv, Gs, CAP, F, TOKENS, L, C,
        BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        p = tl.program_id(0).to(tl.int64)
        hist = floor_counts(
            ASSIGNMENT, LENGTH, START, DENSITY, FLOOR_SHARE, LISTED, COUNTS, EXACT, p, Hkv, Gs, CAP, F, TOKENS, L,
            BLOCK, BLOCK_C,
        )  # fmt: skip
        offs = tl.arange(0, BLOCK_C)
        tl.store(OUT + p * C + offs, hist, mask=offs < C)


C, CAP, F, HKV, GS = 8, 256, 4, 2, 2


def shortlists(seed: int):
    """Rows of a batch of one: listed positions (in position order), exact logits with many ties (a few distinct
    values), lengths (one row empty), each position's cluster."""
    gen = torch.Generator().manual_seed(seed)
    rows, L = HKV * GS, 48
    listed = torch.stack([torch.randperm(CAP - F, generator=gen)[:L].sort().values for _ in range(rows)]).int()
    exact = torch.randint(0, 5, (rows, L), generator=gen).float() * 0.25 - 0.5  # ties across the row
    counts = torch.tensor([L, 37, 0, 11], dtype=torch.int32)
    assignment = torch.randint(0, C, (1, HKV, CAP), generator=gen)  # tied entries in different clusters
    return listed, exact, counts, assignment


def expected(listed, exact, counts, assignment, k2: int) -> torch.Tensor:
    """Per row: its first min(k2, length) entries by exact logit, descending, ties by entry (a stable sort)."""
    out = torch.zeros(listed.shape[0], C, dtype=torch.int32)
    for p in range(listed.shape[0]):
        n = int(counts[p])
        order = torch.sort(-exact[p, :n], stable=True).indices[: min(k2, n)]
        clusters = assignment[0, p // GS, listed[p, order].long()]
        out[p] = torch.bincount(clusters, minlength=C).int()
    return out


@pytest.mark.parametrize("block", [64, 16])  # the shortlist in one block, and across three
@pytest.mark.parametrize("seed", [0, 1])
def test_the_floor_takes_the_best_entries_ties_to_the_earlier_one(block, seed):
    listed, exact, counts, assignment = shortlists(seed)
    L = listed.shape[1]
    tokens = 44  # E_sel = 44 - F = 40, the floor f·E_sel = 20 entries: the cut falls inside a run of ties
    out = torch.full((listed.shape[0], C), -1, dtype=torch.int32)
    _floor[(listed.shape[0],)](
        assignment, torch.tensor([CAP]), torch.zeros(1, dtype=torch.long), torch.tensor([0.0], dtype=torch.float64),
        torch.tensor([0.5], dtype=torch.float64), listed, counts, exact, out, HKV, GS, CAP, F, tokens, L, C,
        BLOCK=block, BLOCK_C=C,
    )  # fmt: skip
    want = expected(listed, exact, counts, assignment, k2=20)
    assert torch.equal(out, want)
    assert int(want.sum()) == 20 + 20 + 0 + 11  # rows cut at 20, one empty, one shorter than the floor
