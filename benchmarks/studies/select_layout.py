"""Is the per-cluster selection bound by gathering its scores? ``launch_select`` (the fused step's selection) on the
same clusters, quotas and scores, laid out two ways:

- ``scattered``: the step's layout — scores in position order, a cluster's members anywhere in the context (QGC's
  clusters are semantic, not positional), so each member's 4-byte score costs the 32-byte sector it lies in;
- ``grouped``: the positions renumbered cluster by cluster (each cluster's members one run of positions, in the same
  order), the scores moved with them: each cluster's scores are read as one contiguous run.

The two read the same scores in the same order within each cluster, so they select the same members (checked, mapped
back to the positions). The difference in time is what the gathers cost, i.e. what a step would gain whose scores
were written in member order. Synthetic inputs at the Llama-3.1-8B shape (8 KV heads, 4 selection rows a head: per
head), 64 clusters (QGC's default) of random positions, quotas water-filled from random priorities to the budget at
each density (the sink and window's 68 rows taken off); one class of cluster sizes per shape, as in the step.

    python benchmarks/studies/select_layout.py [OUT.json]                      # on a GPU
    TRITON_INTERPRET=1 python benchmarks/studies/select_layout.py --cpu        # a small check of the two layouts
"""

from __future__ import annotations

import sys

import torch

import headline_scripts  # (benchmarks/ on the path: the headline scripts import)
from kernel_h200 import bench, graphed
from oa_core.ops.scatter import count_by_slot
from oa_core.ops.selection import cluster_members, launch_select, smallest_block

HKV, GS, C, FIXED = 8, 4, 64, 68
SHAPES = [(16, 16384), (32, 32768), (2, 131072)]
DENSITIES = (0.01, 0.03)


def inputs(batch: int, context: int, density: float, device: torch.device, seed: int = 0):
    """(scores [rows, N], assignment [B, Hkv, N], quotas [rows, C]) for one shape: every position in a cluster."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = batch * HKV * GS
    assignment = torch.randint(0, C, (batch, HKV, context), generator=gen)
    scores = torch.randn(rows, context, generator=gen)
    counts = count_by_slot(assignment, C).repeat_interleave(GS, dim=1).reshape(rows, C)
    budget = max(int(density * context) - FIXED, 1)
    weight = torch.rand(rows, C, generator=gen) ** 4  # a few clusters take most, as ErrorGate's priorities do
    quotas = torch.minimum((weight / weight.sum(-1, keepdim=True) * budget).floor().long(), counts)
    return scores.to(device), assignment.to(device), quotas.to(device)


def grouped(scores: torch.Tensor, assignment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same clusters with the positions renumbered cluster by cluster → (scores, assignment, new → old position
    ``[B, Hkv, N]``)."""
    batch, hkv, context = assignment.shape
    order = assignment.argsort(dim=-1, stable=True)  # new position → old, grouped by cluster, in position order
    moved = scores.view(batch, hkv, GS, context).gather(-1, order[:, :, None, :].expand(-1, -1, GS, -1))
    return moved.reshape(-1, context).contiguous(), assignment.gather(-1, order), order


def run(scores, assignment, quotas):
    """The selection's launches for these inputs → (a function that runs them, its output [rows, width])."""
    members, counts = cluster_members(assignment, C)
    offsets = (quotas.cumsum(-1) - quotas).contiguous()
    width = int(quotas.sum(-1).max())
    out = torch.full((quotas.shape[0], max(width, 1)), -1, dtype=torch.long, device=scores.device)
    small = smallest_block(assignment.shape[-1] / C)

    def select():
        launch_select(scores, members, counts, quotas, offsets, out, GS, small)

    return select, out


def measure(batch: int, context: int, density: float, device: torch.device, timed: bool) -> dict:
    scores, assignment, quotas = inputs(batch, context, density, device)
    far, far_out = run(scores, assignment, quotas)
    near_scores, near_assignment, order = grouped(scores, assignment)
    near, near_out = run(near_scores, near_assignment, quotas)
    far(), near()
    # The grouped run's positions mapped back to the original ones: the same members, cluster by cluster.
    rows_order = order.repeat_interleave(GS, dim=1).reshape(quotas.shape[0], -1)
    back = torch.where(near_out >= 0, rows_order.gather(-1, near_out.clamp_min(0)), near_out)
    same = all(torch.equal(a[a >= 0].sort().values, b[b >= 0].sort().values) for a, b in zip(far_out.cpu(), back.cpu()))
    record = {"batch": batch, "context": context, "density": density, "same_members": same}
    record["picked_per_row"] = round(float(quotas.sum(-1).float().mean()), 1)
    if timed:
        record["scattered_ms"] = round(bench(graphed(far)), 4)
        record["grouped_ms"] = round(bench(graphed(near)), 4)
        record["gather_share"] = round(1 - record["grouped_ms"] / record["scattered_ms"], 3)
    return record


def main(argv: list[str]) -> int:
    gpu = [(*shape, density) for shape in SHAPES for density in DENSITIES]
    cpu = [(1, 2048, density) for density in (0.1, 0.3)]  # (a budget above the sink and window)
    return headline_scripts.sweep(argv, __doc__, measure, gpu, cpu, "same_members")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
