"""Would PQS's scores cost less as a dot with the keys its codes rebuild than as table lookups?

PQS scores a key by Σ_m q_m·μ_{m, code_m}: today a table of q_m·μ_{m,c} per query head and a gather per (head,
sub-space) — 256 gathers a key per head at the Llama-3.1-8B shape (4 query heads of 64 sub-spaces), which took
about dense attention's time per layer on an H100 (``results/fused_pqs_step_final_h100.json``). The same sum is
q·k̂, k̂ the key rebuilt from its centroids: one gather per (sub-space, dimension) a key whatever the heads — 128 — then
one dot for all the group's heads (``tl.dot``, on tensor cores in bfloat16, or in float32). A third form has no
gather at all: the codes as one-hot rows (M·C of them a key, 1024 at 16 centroids of 64 sub-spaces) times the heads'
tables on tensor cores — more arithmetic, none of it shuffles. This study times the forms on the same codes and
says how far each form's scores are from the tables' (their order decides the rows read: the share of each row's
top 4% both forms keep).

    python benchmarks/studies/pq_score_forms.py        # on the GPU: results/pq_score_forms_<gpu>.json
    python benchmarks/studies/pq_score_forms.py --batch 1 --context 256   # a check of the kernel on the CPU

(The interpreter's bfloat16 ``tl.dot`` gives wrong sums: the CPU check holds for the float32 forms only.)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from kernel_h200 import bench, graphed  # noqa: E402
from oa_core.analysis.provenance import provenance  # noqa: E402
from oa_plugins.selectors.pq import code_block, group_lut_scores, load_codes, pack_codes  # noqa: E402


@triton.jit
def _rebuilt_scores(
    CENT,
    CODES,
    Q,
    OUT,
    N,
    scale,
    GQ: tl.constexpr,
    M: tl.constexpr,
    C: tl.constexpr,
    W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HALF: tl.constexpr,
):
    """Program (batch row · KV head, block of keys): the block's keys rebuilt from their codes (two dimensions a
    sub-space: each dimension's centroid coordinates in registers, gathered by the codes), then s·q·k̂ for the GQ query
    heads in one ``tl.dot`` → OUT ``[heads, GQ, N]``."""
    head = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs < N
    offs_m = tl.arange(0, BLOCK_M)
    codes = load_codes(CODES + head * N * W, offs, in_n, W, M, True, BLOCK_M)  # [BLOCK_N, BLOCK_M]
    centre = CENT + head * (M * C * 2) + offs_m[None, :] * (C * 2) + tl.arange(0, C)[:, None] * 2  # [C, BLOCK_M]
    first = tl.load(centre, mask=(offs_m < M)[None, :], other=0.0)
    second = tl.load(centre + 1, mask=(offs_m < M)[None, :], other=0.0)
    x = tl.gather(first, codes, axis=0)  # [BLOCK_N, BLOCK_M]: x[n, m] = first[code[n, m], m]
    y = tl.gather(second, codes, axis=0)
    rebuilt = tl.reshape(tl.join(x, y), [BLOCK_N, 2 * BLOCK_M])  # [BLOCK_N, D]: (m, e) → 2m + e
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, 2 * BLOCK_M)
    q = tl.load(
        Q + (head * GQ + offs_q[:, None]) * (2 * M) + offs_d[None, :],
        mask=(offs_q < GQ)[:, None] & (offs_d < 2 * M)[None, :],
        other=0.0,
    )
    if HALF:
        dots = tl.dot(rebuilt.to(tl.bfloat16), tl.trans(q.to(tl.bfloat16)))
    else:
        dots = tl.dot(rebuilt, tl.trans(q), input_precision="ieee")
    tl.store(
        OUT + (head * GQ + offs_q[None, :]) * N + offs[:, None],
        dots * scale,
        mask=in_n[:, None] & (offs_q < GQ)[None, :],
    )


def launch(kernel, inputs: tuple, out, codes, scale, block_n: int, warps: int, **constants) -> torch.Tensor:
    """A study kernel: a program per (batch row · KV head, block of ``block_n`` keys) over ``codes`` ``[B, H, N,
    W]``; its arguments are the first of ``inputs``, the codes, the rest of ``inputs``, OUT ``[B, H, GQ, N]``, N and
    the scale (GQ padded to a tensor-core block)."""
    B, H, N, W = codes.shape
    GQ = out.shape[2]
    kernel[(B * H, triton.cdiv(N, block_n))](
        *inputs[:1],
        codes,
        *inputs[1:],
        out,
        N,
        scale,
        GQ=GQ,
        W=W,
        BLOCK_N=block_n,
        BLOCK_Q=max(16, triton.next_power_of_2(GQ)),
        num_warps=warps,
        **constants,
    )
    return out


def rebuilt_scores(centroids, codes, queries, scale, half: bool, block_n: int = 64, warps: int = 4):
    """centroids ``[B, H, M, C, 2]``, codes ``[B, H, N, M/2]`` packed, queries ``[B, H, GQ, D]`` → ``[B, H, GQ, N]``."""
    B, H, M, C, _ = centroids.shape
    out = torch.empty(B, H, queries.shape[2], codes.shape[2], device=codes.device, dtype=torch.float32)
    inputs = (centroids, queries.float().contiguous())
    return launch(
        _rebuilt_scores, inputs, out, codes, scale, block_n, warps, M=M, C=C, BLOCK_M=code_block(M), HALF=half
    )


@triton.jit
def _onehot_scores(
    TABLES,
    CODES,
    OUT,
    N,
    scale,
    GQ: tl.constexpr,
    M: tl.constexpr,
    C: tl.constexpr,
    W: tl.constexpr,
    MB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    FORM: tl.constexpr,
):
    """Program (batch row · KV head, block of keys): Σ_m T[m, code_m] as a matrix product with no gather — per MB
    sub-spaces, the block's codes as one-hot rows ``[BLOCK_N, MB·C]`` (exact in any float type) times the GQ heads'
    tables ``[MB·C, GQ]`` (``tl.dot``, tensor cores): FORM 0 float32 (ieee: the CPU check), 1 tf32, 2 the tables
    in float16, 3 the tables split into two bfloat16 parts (hi + lo: about 16 bits of each entry) → OUT
    ``[heads, GQ, N]``."""
    head = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs < N
    offs_q = tl.arange(0, BLOCK_Q)
    offs_k = tl.arange(0, MB * C)
    centre = tl.arange(0, C)
    acc = tl.zeros([BLOCK_N, BLOCK_Q], tl.float32)
    for m0 in range(0, M, MB):
        codes = load_codes(CODES + head * N * W + m0 // 2, offs, in_n, W, MB, True, MB)  # [BLOCK_N, MB]
        hot = tl.reshape(codes[:, :, None] == centre[None, None, :], [BLOCK_N, MB * C])
        table = tl.load(
            TABLES + (head * GQ + offs_q[None, :]) * (M * C) + m0 * C + offs_k[:, None],
            mask=(offs_q < GQ)[None, :],
            other=0.0,
        )  # [MB·C, BLOCK_Q]
        if FORM == 0:
            acc += tl.dot(hot.to(tl.float32), table, input_precision="ieee")
        elif FORM == 1:
            acc += tl.dot(hot.to(tl.float32), table, input_precision="tf32")
        elif FORM == 2:
            acc += tl.dot(hot.to(tl.float16), table.to(tl.float16))
        else:
            hi = table.to(tl.bfloat16)
            lo = (table - hi.to(tl.float32)).to(tl.bfloat16)
            acc += tl.dot(hot.to(tl.bfloat16), hi)
            acc += tl.dot(hot.to(tl.bfloat16), lo)
    tl.store(
        OUT + (head * GQ + offs_q[None, :]) * N + offs[:, None],
        acc * scale,
        mask=in_n[:, None] & (offs_q < GQ)[None, :],
    )


ONEHOT_FORMS = {0: "one-hot, fp32 dot", 1: "one-hot, tf32 dot", 2: "one-hot, fp16 tables", 3: "one-hot, bf16 hi+lo"}


def onehot_scores(tables, codes, scale, form: int, block_n: int = 64, sub_spaces: int = 4, warps: int = 4):
    """tables ``[B, H, GQ, M, C]``, codes ``[B, H, N, M/2]`` packed → ``[B, H, GQ, N]`` (``_onehot_scores``)."""
    B, H, GQ, M, C = tables.shape
    out = torch.empty(B, H, GQ, codes.shape[2], device=codes.device, dtype=torch.float32)
    inputs = (tables.float().contiguous(),)
    return launch(_onehot_scores, inputs, out, codes, scale, block_n, warps, M=M, C=C, MB=sub_spaces, FORM=form)


def kept_share(a: torch.Tensor, b: torch.Tensor, share: float = 0.04) -> float:
    """The mean share of each row's top ``share`` by ``a`` that the top by ``b`` keeps."""
    k = max(1, int(share * a.shape[-1]))
    top_a = torch.zeros_like(a, dtype=torch.bool).scatter_(-1, a.topk(k, dim=-1).indices, True)
    top_b = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, b.topk(k, dim=-1).indices, True)
    return float((top_a & top_b).sum(-1).float().mean() / k)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    B, H, g, N, D, C = args.batch, 8, 4, args.context, 128, 16
    M = D // 2
    gen = torch.Generator(device=device).manual_seed(0)
    centroids = torch.randn(B, H, M, C, 2, device=device, generator=gen)
    codes = pack_codes(torch.randint(0, C, (B, H, N, M), device=device, generator=gen).to(torch.uint8))
    queries = torch.randn(B, H, g, D, device=device, generator=gen)
    tables = torch.einsum("bhgmd,bhmcd->bhgmc", queries.view(B, H, g, M, 2), centroids)
    lut = group_lut_scores(tables, codes, 0.1, 1, 1)  # per head: [B, H, g, N]
    timed = device.type == "cuda"
    runs: list[dict] = []

    def measure(run, **fields) -> None:
        """One launch of a form: its scores against the tables' and, on the GPU, its time; appended and printed."""
        row = dict(fields)
        if fields["form"] != "tables":
            got = run()
            row["max_abs_diff"] = float((got - lut).abs().max())
            row["kept_of_top_4pct"] = kept_share(lut.flatten(0, 2), got.flatten(0, 2))
        row["ms"] = bench(graphed(run)) if timed else None
        runs.append(row)
        print(row, flush=True)

    measure(functools.partial(group_lut_scores, tables, codes, 0.1, 1, 1), form="tables")
    launches = [(32, 4), (64, 4), (128, 4), (64, 8), (128, 8)]
    for half in (False, True) if timed else (False,):  # the interpreter: the float32 forms only
        for block_n, warps in launches if timed else launches[:1]:
            run = functools.partial(rebuilt_scores, centroids, codes, queries, 0.1, half, block_n, warps)
            name = "rebuilt, bf16 dot" if half else "rebuilt, fp32 dot"
            measure(run, form=name, block_n=block_n, warps=warps)
    launches = [(64, 4, 4), (128, 4, 4), (64, 8, 4), (128, 8, 8), (128, 2, 4)]
    for form, name in ONEHOT_FORMS.items() if timed else list(ONEHOT_FORMS.items())[:1]:
        for block_n, sub, warps in launches if timed else launches[:1]:
            run = functools.partial(onehot_scores, tables, codes, 0.1, form, block_n, sub, warps)
            measure(run, form=name, block_n=block_n, sub_spaces_per_dot=sub, warps=warps)
    result = {
        "what": __doc__.split("\n\n")[0],
        "shape": {"batch": B, "kv_heads": H, "group": g, "context": N, "head_dim": D, "centroids": C},
        "runs": runs,
        "provenance": provenance(device),
    }
    name = torch.cuda.get_device_name().split()[1].lower() if timed else "cpu"
    out = args.out or ROOT / "benchmarks" / "studies" / "results" / f"pq_score_forms_{name}.json"
    if timed or args.out:
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
