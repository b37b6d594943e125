"""The fused step's CUDA shortlist (``oa_plugins/kernels/pq_shortlist.cu``) against the three Triton launches it
replaces (``pq_scores``, ``pq_cut``, ``pq_list``), on the same inputs at the Llama-3.1-8B shape, and its phases timed
apart (GPU only, sm_90+).

Inputs: random tables (a KV head's query heads in part alike: ``group_tables``) and 4-bit codes of 64 sub-spaces (head
dim 128), keys and queries (bf16), clusters of random positions (the sink and the local window outside), per head (4
selection rows a KV head) and shared, the default's rerank 4 at 1% and 3%. Checks, at that scale: both ways give the
same lengths, cuts, ties and listed positions, exact logits and scores within float rounding (the sums run in another
order), the same boxes. Timed (median ms, eagerly and replayed from a CUDA graph): the three launches; the CUDA launch
stopped after the scores, after the cut (its ``stop`` knob), and whole (the listing), each phase's cost the difference;
with Triton's ``exact_logits`` after it (the step's two launches). ``union_share``: the distinct K rows a KV head's
rows list over their entries (what a read of the union would save).
Writes ``benchmarks/studies/results/pq_shortlist_phases_<gpu>.json``.

    python benchmarks/studies/pq_shortlist_phases.py
"""

from __future__ import annotations

import argparse
import functools
import json
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

HKV, HQ, D, M, CC, C = 8, 32, 128, 64, 16, 64
SINK, LOCAL, RERANK, FLOOR = 4, 64, 4.0, 0.5
# The query heads' own part of their tables: at 0.7 a KV head's four shortlists take about 0.63 of their entries' K
# rows (``union_share``), as on SmolLM2 and Gemma (2.45–2.52 rows of 4: ``benchmarks/results/step_cost.json``).
HEAD_SPREAD = 0.7
# The CUDA launch stopped after a phase (``stop``), whole (3: without the exact logits), and with Triton's
# ``exact_logits`` after it (0: the step's).
STOPS = {"scores": 1, "scores_and_cut": 2, "listing": 3, "with_exact_logits": 0}


def inputs(batch: int, context: int, device: torch.device):
    """A state-like namespace with the index, clusters and bookkeeping the launches read, the keys, the query."""
    gen = torch.Generator(device=device).manual_seed(0)
    n = context
    codes = torch.randint(0, 256, (batch, HKV, n, M // 2), dtype=torch.uint8, device=device, generator=gen)
    assignment = torch.randint(0, C, (batch, HKV, n), device=device, generator=gen)
    assignment[:, :, :SINK] = C
    assignment[:, :, n - LOCAL :] = C
    index = SimpleNamespace(codes=codes, centroids=torch.empty(batch, HKV, M, CC, D // M, device=device))
    state = SimpleNamespace(
        index=index,
        assignment=assignment,
        num_clusters=C,
        length=torch.tensor([n], device=device),
        start=torch.zeros(batch, dtype=torch.long, device=device),
        capacity=n,
        scale=D**-0.5,
        pipeline=SimpleNamespace(spec=SimpleNamespace(sink=SINK, local=LOCAL)),
    )
    keys = torch.randn(batch, HKV, n, D, device=device, generator=gen).to(torch.bfloat16)
    query = torch.randn(batch, HQ, 1, D, device=device, generator=gen).to(torch.bfloat16)
    return state, keys, query


def group_tables(batch: int, device: torch.device) -> torch.Tensor:
    """Random tables ``[batch, HKV, G, M, CC]`` whose G query heads of a KV head share a component (HEAD_SPREAD the
    heads' own part): their shortlists overlap in part, as a model's do."""
    shape = (batch, HKV, HQ // HKV, M, CC)
    return torch.randn(*shape[:2], 1, *shape[3:], device=device) + HEAD_SPREAD * torch.randn(shape, device=device)


def union_share(listing, heads: int, Gs: int) -> float:
    """The distinct positions listed by a KV head's rows over the entries of all of them, summed over the KV heads:
    the share of the per-row reads that the union reads."""
    listed = [row[: int(n)].tolist() for row, n in zip(listing.listed.cpu(), listing.counts.cpu(), strict=True)]
    entries = sum(len(row) for row in listed)
    distinct = sum(len(set().union(*listed[i * Gs : (i + 1) * Gs])) for i in range(heads))
    return distinct / max(entries, 1)


def reference_scores(state, tables: torch.Tensor, Gs: int, G: int) -> torch.Tensor:
    """PQS's scores in torch: s·max over a row's G heads of Σ_m table[m, code_m], -inf outside the clusters (the
    row leaving the window inside) and past the length → ``[B·Hkv·Gs, capacity]`` float32."""
    codes = state.index.codes.long()  # [B, H, N, W], two 4-bit codes a byte: sub-space 2j low, 2j + 1 high
    codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)
    B, H, N, M = codes.shape
    sums = torch.zeros(B, H, Gs * G, N, device=codes.device)
    for m in range(M):
        table = tables.reshape(B, H, Gs * G, M, -1)[:, :, :, m]  # [B, H, J, CC]
        sums += table.gather(-1, codes[:, :, None, :, m].expand(-1, -1, Gs * G, -1))
    scores = sums.view(B, H, Gs, G, N).amax(3) * state.scale
    n = int(state.length)
    position = torch.arange(N, device=codes.device)
    inside = ((state.assignment != state.num_clusters) | (position == n - 1 - state.pipeline.spec.local)) & (
        position < n
    )
    return scores.masked_fill(~inside[:, :, None], float("-inf")).reshape(B * H * Gs, N)


def listing_faults(state, tables, keys, query, Gs: int, G: int, listing, scores, counts) -> dict[str, int]:
    """What a shortlist (``two_stage.Listing``) and its boxed ``scores`` get wrong against torch, row by row, with the
    sums' rounding allowed for (the kernel's and torch's run in other orders) → the rows at fault, per check (all 0:
    none). ``counts``: each row's expected length. Checked: the lengths; positions listed in increasing order, all
    inside; every listed position boxed with its entry, nothing else boxed; the other scores torch's; every key
    clearly above the k-th best listed and every one clearly below it not; among keys of the same codes (the same
    score, to the bit, in any order of sums) the earlier listed first; the cut the k-th best score; each entry's
    exact logit s·max_j q_j·k."""
    ref = reference_scores(state, tables, Gs, G)
    rows, N = ref.shape
    n = int(state.length)
    B, H = keys.shape[:2]
    codes = state.index.codes.reshape(B * H, N, -1)[:, :n]
    queries = query.float().reshape(B, H, Gs, G, -1)
    faults = dict.fromkeys(("length", "order", "boxes", "scores", "selection", "tie_order", "cut", "exact"), 0)
    groups: dict[int, torch.Tensor] = {}
    for row in range(rows):
        k, head = int(listing.counts[row]), row // Gs
        b, h, s = head // H, head % H, row % Gs
        faults["length"] += k != int(counts[row])
        listed = listing.listed[row, :k].long()
        mine, theirs = scores[row, :n], ref[row, :n]
        inside = theirs > float("-inf")
        faults["order"] += bool(k and ((listed[1:] <= listed[:-1]).any() or not inside[listed].all()))
        boxed = mine.isnan()
        entries = (mine[listed].view(torch.int32) & 0x7FFFFF) - 1
        named = torch.equal(entries.cpu(), torch.arange(k))  # each box names its own entry
        faults["boxes"] += bool(int(boxed.sum()) != k or not boxed[listed].all() or not named)
        other = ~boxed
        tolerance = 1e-5 * (1 + theirs[inside].abs().max()) if inside.any() else 0
        faults["scores"] += bool(
            not torch.equal(mine[other] == float("-inf"), theirs[other] == float("-inf"))
            or ((mine[other] - theirs[other]).abs()[inside[other]] > tolerance).any()
        )
        chosen = torch.zeros(n, dtype=torch.bool, device=ref.device)
        chosen[listed] = True
        if k:
            tau = theirs.topk(k).values[-1]
            faults["selection"] += bool(
                (inside & (theirs > tau + tolerance) & ~chosen).any() or (chosen & (theirs < tau - tolerance)).any()
            )
            key = int(listing.cut[row]) - 2**31  # ``order_key`` undone: the last listed score
            cut = struct.unpack("<f", struct.pack("<I", key if key >= 0 else (-key) | 0x80000000))[0]
            faults["cut"] += bool(abs(cut - float(tau)) > float(tolerance))
            exact = (keys[b, h, listed].float() @ queries[b, h, s].T).amax(-1) * state.scale
            faults["exact"] += bool(not torch.allclose(listing.exact[row, :k], exact, rtol=1e-4, atol=1e-4))
        # The same codes score the same: where a later one is listed, every earlier inside one is too.
        if head not in groups:  # the head's keys by their codes (one grouping for its selection rows)
            groups[head] = torch.unique(codes[head], dim=0, return_inverse=True)[1]
        group = groups[head]
        places = torch.arange(n, device=ref.device)
        last_listed = torch.full((int(group.max()) + 1,), -1, device=ref.device).scatter_reduce(
            0, group[chosen], places[chosen], "amax"
        )
        unlisted = inside & ~chosen
        first_unlisted = torch.full_like(last_listed, n).scatter_reduce(0, group[unlisted], places[unlisted], "amin")
        faults["tie_order"] += bool((first_unlisted < last_listed).any())
    return faults


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["16x16384", "32x32768", "2x131072"])
    parser.add_argument("--density", type=float, nargs="+", default=[0.01, 0.03])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("needs a CUDA GPU of sm_90 or later", file=sys.stderr)
        return 1
    import triton.testing

    from oa_core.analysis.provenance import provenance
    from oa_plugins.kernels import pq_shortlist_cuda
    from oa_plugins.kernels.two_stage import TwoStage

    def timed(fn) -> dict[str, float]:
        return {
            "eager_ms": round(triton.testing.do_bench(fn, return_mode="median"), 4),
            "graph_ms": round(triton.testing.do_bench_cudagraph(fn, return_mode="median"), 4),
        }

    device = torch.device("cuda")
    runs = []
    for shape in args.shapes:
        batch, context = (int(v) for v in shape.split("x"))
        state, keys, query = inputs(batch, context, device)
        reason = pq_shortlist_cuda.unavailable_reason(state)
        if reason is not None:
            print(f"{shape}: {reason}", file=sys.stderr)
            return 1
        for gqa in ("per_head", "shared"):
            Gs, G = (HQ // HKV, 1) if gqa == "per_head" else (1, HQ // HKV)
            for density in args.density:
                tables = group_tables(batch, device)
                width = max(int(density * context) - SINK - LOCAL, 0)  # E_sel at capacity (``StaticState.width``)
                two_stage = TwoStage(RERANK, FLOOR, width, context, device)
                budget = (state.length, state.start, torch.tensor(density, dtype=torch.float64, device=device))
                budget_args = (*budget, SINK + LOCAL, -1)
                rows = batch * HKV * Gs
                three_scores = torch.empty(rows, context, device=device)
                one_scores = torch.empty_like(three_scores)

                rest = (keys, query, budget_args, Gs, G)
                three = functools.partial(two_stage.pq_shortlist, tables, state, three_scores, *rest)
                one = functools.partial(pq_shortlist_cuda.launch, two_stage, state, tables, one_scores, *rest)

                check = functools.partial(listing_faults, state, tables, keys, query, Gs, G)
                expected, got = three(), one()
                torch.cuda.synchronize()
                counts = expected.counts
                same = {"cuda_faults": check(got, one_scores, counts)}
                same["triton_faults"] = check(expected, three_scores, counts)
                same["mean_length"] = float(counts.float().mean())
                same["union_share"] = union_share(expected, batch * HKV, Gs)
                record = {"batch": batch, "context": context, "gqa": gqa, "density": density, "checks": same}
                record["triton_three_launches"] = timed(three)
                for name, stop in STOPS.items():
                    record[f"cuda_{name}"] = timed(functools.partial(one, stop))
                runs.append(record)
                faults = {f"{way} {k}": v for way in ("cuda", "triton") for k, v in same[f"{way}_faults"].items() if v}
                print(
                    f"{batch:>2} × {context:>6} {gqa:8s} {density:.0%}: rows at fault {faults or 'none'}; "
                    f"union share {same['union_share']:.3f}; graphed ms — Triton "
                    f"{record['triton_three_launches']['graph_ms']:.3f}; CUDA "
                    + ", ".join(f"{name} {record[f'cuda_{name}']['graph_ms']:.3f}" for name in STOPS),
                    flush=True,
                )
    gpu = torch.cuda.get_device_name().split()[1].lower()
    out = args.out or Path(__file__).parent / "results" / f"pq_shortlist_phases_{gpu}.json"
    record = {"what": __doc__.split("\n\n")[0], "runs": runs, "provenance": provenance("cuda")}
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
