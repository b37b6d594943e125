"""What each Triton kernel needs of an sm_90 GPU (H100/H200) at a head dim, compiled here without a GPU.

    python benchmarks/studies/kernel_resources.py                       # head dims 64, 128, 256 → JSON on stdout
    python benchmarks/studies/kernel_resources.py --dims 256 --out benchmarks/studies/results/kernel_resources_sm90.json

Each kernel is compiled with the block sizes and launch options its caller picks at that head dim (``flash``'s pass, key
k-means' Lloyd step, nearest centroid and k-means++, PQS's shortlist and the fused step's prologue), and read back from
the cubin: registers, the stack a thread spills to (``cuobjdump -res-usage``) and the shared memory. A kernel whose
shared memory passes the 227 KB an sm_90 block can have does not launch; a large stack is reserved by the driver for
every thread the GPU can hold (2048 per SM × 132 SMs: 1 GiB per process at 4 KB), which ran ten ranks on one H200 out of
memory at Gemma-3's head dim 256. ``tests/plugins/test_kernel_resources.py`` holds every kernel to these limits.

Needs Triton's NVIDIA backend (its ptxas and cuobjdump ship in the wheel), not a GPU; runs with TRITON_INTERPRET
unset (the interpreter's kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SHARED_LIMIT = 232448  # bytes of shared memory an sm_90 block may use
STACK_LIMIT = 4096  # bytes a thread may spill: 1 GiB reserved per process on an H200


def _usage(kernel) -> dict:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    found = dict(re.findall(r"(REG|STACK):(\d+)", text))
    return {"registers": int(found["REG"]), "stack": int(found["STACK"]), "shared": int(kernel.metadata.shared)}


def _compile(fn, types: dict[str, str], constants: dict, **options) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in names}
    source = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(name),): value for name, value in constants.items()}
    )
    return _usage(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options))


def measure(dims: list[int], dtypes: tuple[str, ...] = ("fp32", "bf16")) -> list[dict]:
    """One row per (kernel, head dim[, dtype]): its launch parameters and what it needs."""
    import triton

    from oa_core.ops import kmeans
    from oa_plugins.kernels import flash, flash_programs

    kernel = flash.FlashKernel
    rows = []
    for dim in dims:
        block_d = max(16, triton.next_power_of_2(dim))
        # The pass with second-order proxies, 4 query heads per KV head (Gemma-3's, Llama's), reading the pooled sums
        # (the composed path) or the fused step's logit statistics.
        for dtype, stats in itertools.product(dtypes, (False, True)):
            constants = dict(
                G=4,
                BLOCK_G=16,
                BLOCK_K=kernel.block_k or flash.block_columns(block_d),
                CHUNK_C=kernel.clusters_per_chunk or 16,
                D=dim,
                BLOCK_D=block_d,
                PROXY=True,
                SECOND=True,
                STATS=stats,
                HALF=dtype != "fp32",
                BLOCK_PARTS=4,  # 64 clusters, 16 a part
            )
            types = dict(
                Q=f"*{dtype}",
                K=f"*{dtype}",
                V=f"*{dtype}",
                IDX="*i64",
                LW="*fp32",
                RUNS="*i32",
                KSUM="*fp32",
                VSUM="*fp32",
                COUNT="*fp32",
                KSQ="*fp32",
                MEAN_LOGIT="*fp32",
                LOGIT_VAR="*fp32",
                M_OUT="*fp32",
                L_OUT="*fp32",
                ACC_OUT="*fp32",
                USED_OUT="*i32",
                ARRIVALS="*i32",
                OUT=f"*{dtype}",
                USED="*i32",
                scale="fp32",
            )
            rows.append(
                {
                    "kernel": "flash_programs.sparse_pass",
                    "dim": dim,
                    "dtype": dtype,
                    "logit_stats": stats,
                    "block_k": constants["BLOCK_K"],
                    **_compile(
                        flash_programs.sparse_pass,
                        types,
                        constants,
                        num_warps=kernel.num_warps or 4,
                        num_stages=kernel.num_stages or 3,
                    ),
                }
            )
        points = dict(
            X="*fp32",
            W="*fp32",
            CENT="*fp32",
            CENT_NEXT="*fp32",
            ASSIGNMENT="*i64",
            SUMS="*fp64",
            DELTAS="*fp64",
            ARRIVED="*i32",
            MOVED="*i32",
            OUT="*i64",
        )
        block_r = max(16, triton.next_power_of_2(dim))
        for name, fn, extra in (
            ("kmeans._lloyd_step", kmeans._lloyd_step, {"FIRST": False}),
            ("kmeans._nearest", kmeans._nearest, {}),
        ):
            constants = dict(
                R=dim, BLOCK_R=block_r, BLOCK_C=32, BLOCK_N=kmeans.lloyd_block(block_r), PRECISION="tf32x3", **extra
            )
            rows.append(
                {
                    "kernel": name,
                    "dim": dim,
                    "block_n": constants["BLOCK_N"],
                    **_compile(fn, points, constants, num_warps=4),
                }
            )
        constants = dict(
            R=dim,
            BLOCK_R=triton.next_power_of_2(dim),
            BLOCKS=8,
            BLOCK_N=kmeans.plus_plus_block(triton.next_power_of_2(dim)),
        )
        rows.append(
            {
                "kernel": "kmeans._kmeans_plus_plus",
                "dim": dim,
                "block_n": constants["BLOCK_N"],
                **_compile(
                    kmeans._kmeans_plus_plus,
                    dict(X="*fp32", W="*fp32", DRAWS="*fp64", CENT="*fp32", CLOSEST="*fp32"),
                    constants,
                    num_warps=32,
                ),
            }
        )
        rows += pq_shortlist_rows(dim, first=dim == dims[0])
        rows += pq_prepare_rows(dim, first=dim == dims[0])
        rows.append(prologue_row(dim))
    rows += plan_select_rows()  # (no head dim)
    for row in rows:
        row["fits"] = row["shared"] <= SHARED_LIMIT and row["stack"] <= STACK_LIMIT
    return rows


def prologue_row(dim: int) -> dict:
    """The fused step's first launch for the default (PQS's codes and tables with QGC's growth, 4 query heads a KV
    head, 64 clusters of rank 16) at ``dim``, bf16 keys."""
    from oa_plugins.kernels import flash_step_programs
    from oa_plugins.selectors.pq import code_block

    M = dim // 2
    constants = dict(G=4, D=dim, BLOCK_D=max(16, 1 << (dim - 1).bit_length()), RC=16, BLOCK_RC=16, BLOCK_C=64)
    constants.update(STATS_C=16, PQ=True, R=1, BLOCK_R=1, M=M, CC=16, DIMS=2, W=M // 2, PACKED=True)
    constants.update(BLOCK_M=code_block(M), BLOCK_CC=16, BLOCK_DIMS=2)
    types = dict(K="*bf16", Q="*bf16", V="*bf16", LENGTH="*i64", CODES="*u8", ASSIGNMENT="*i64", MEMBERS="*i32")
    types.update(MEMBER_COUNT="*i64", scale="fp32", sk_b="i64", sk_h="i64", sk_n="i64", sv_b="i64", sv_h="i64")
    types.update(sv_n="i64", sq_b="i64", sq_h="i64")
    for name in ("SPACE", "SCALES", "OUT", "PROJ", "CENT", "COUNT", "KSUM", "VSUM", "KSQ", "MEAN_LOGIT", "LOGIT_VAR"):
        types[name] = "*fp32"
    usage = _compile(flash_step_programs.prologue, types, constants, num_warps=4)
    return {"kernel": "flash_step_programs.prologue", "dim": dim, "dtype": "bf16", **usage}


def plan_select_rows() -> list[dict]:
    """The fused step's plan (64 clusters), with and without ErrorGate's floor, and the per-cluster selection at each
    size class's block (the largest a block at a time), as ``FusedStep`` and ``select_per_cluster`` launch them."""
    from oa_core.ops import selection
    from oa_plugins.kernels import flash_step, plan_programs, two_stage

    types = dict(MEAN_LOGIT="*fp32", LOGIT_VAR="*fp32", COUNT="*fp32", LENGTH="*i64", START="*i64", DENSITY="*fp64")
    types.update(FIXED_BASE="*i64", FIXED_MOVES="*i64", ASSIGNMENT="*i64", FLOOR_SHARE="*fp64", LISTED="*i32")
    types.update(LISTED_COUNTS="*i32", EXACT="*fp32", CUT="*i64", SHIFTS="*fp32", QUOTAS="*i64", OFFSETS="*i64")
    types.update(RUNS="*i32", INDEX="*i64", LW="*fp32", ARRIVALS="*i32", SCORES="*fp32", MEMBERS="*i32")
    types.update(COUNTS="*i64", OUT="*i64", N="i64", HEAD_STRIDE="i64")
    rows = []
    for floor in (False, True):  # without a floor (its shortlist's pointers stand-ins) and with one (the default)
        plan = dict(G=1, BLOCK_G=1, BLOCK_C=64, BLOCK_F=128, FLOOR=floor, RADIX_BLOCK=two_stage.RADIX_BLOCK)
        plan.update(LIBDEVICE=True)
        stand_in = {} if floor else dict.fromkeys(("LISTED", "LISTED_COUNTS", "EXACT", "CUT", "SHIFTS"), "*i64")
        usage = _compile(plan_programs.plan, {**types, **stand_in}, plan, num_warps=flash_step.PLAN_WARPS)
        rows.append({"kernel": "plan_programs.plan", "floor": floor, **usage})
    # Both ways ``launch_select`` launches the selection: a composed step's scores, a two-stage selection's boxed ones.
    # (A path compiled only for a launch that never takes it still has to compile: the interpreter runs only the paths
    # taken, so a compile failure there shows on a GPU alone — as one did on an H100, 137482d.)
    blocks = (selection.SMALL_CLUSTER, 4 * selection.SMALL_CLUSTER, selection.REGISTER_LIMIT)
    for block, boxed in itertools.product(blocks, (False, True)):
        constants = dict(BLOCK=block, BLOCKWISE=block == selection.REGISTER_LIMIT, FEW=selection.FEW_PICKS, BOXED=boxed)
        usage = _compile(selection._select_kernel, types, constants, num_warps=selection._warps(block))
        rows.append({"kernel": "selection._select_kernel", "block": block, "boxed": boxed, **usage})
    return rows


def pq_shortlist_rows(dim: int, first: bool) -> list[dict]:
    """The default's shortlist (``TwoStage.pq_shortlist``) per head at Llama's group of 4, with its launch constants:
    the scores at PQS's default (16 centroids a pair of dimensions) and the listing at ``dim``; the cut, which no
    head dim changes, with the first."""
    import triton

    from oa_plugins.kernels import pq_shortlist_programs, two_stage
    from oa_plugins.selectors.pq import code_block, lut_block

    M = dim // 2
    scores = dict(GS=4, G=1, M=M, CC=16, W=M // 2, PACKED=True, BLOCK_M=code_block(M), BLOCK_GS=4)
    scores.update(CHUNK=two_stage.SCORE_CHUNK, BLOCK_N=min(lut_block(M, two_stage.SCORE_WARPS), two_stage.SCORE_CHUNK))
    listing = dict(GS=4, G=1, BLOCK_GS=4, D=dim, BLOCK_D=triton.next_power_of_2(dim), SEGMENT=two_stage.PQ_SEGMENT)
    listing.update(BLOCK_L=min(two_stage.PQ_LIST_BLOCK, two_stage.PQ_SEGMENT), BLOCK_U=two_stage.LIST_GATHER)
    pointers = dict(TABLES="*fp32", CODES="*u8", LENGTH="*i64", START="*i64", SCORES="*fp32", HIST="*i32", scale="fp32")
    list_pointers = dict(
        K="*bf16", Q="*bf16", SCORES="*fp32", LENGTH="*i64", LISTED="*i32", EXACT="*fp32", CUT="*i64", TIES="*i32"
    )
    list_pointers.update(PLACES="*i32", SCRATCH="*i32", scale="fp32")
    launches = [
        ("pq_shortlist_programs.pq_scores", pq_shortlist_programs.pq_scores, pointers, scores, two_stage.SCORE_WARPS),
        ("pq_shortlist_programs.pq_list", pq_shortlist_programs.pq_list, list_pointers, listing, two_stage.LIST_WARPS),
    ]
    if first:
        cut_pointers = dict(SCORES="*fp32", HIST="*i32", LENGTH="*i64", START="*i64", DENSITY="*fp64", MULTIPLE="*fp64")
        cut_pointers.update(COUNTS="*i32", CUT="*i64", TIES="*i32", PLACES="*i32", NEAR="*i32")
        cut = dict(SEGMENT=two_stage.PQ_SEGMENT, BLOCK=two_stage.RADIX_BLOCK, BLOCK_S=256)
        cut_fn = pq_shortlist_programs.pq_cut
        launches.append(("pq_shortlist_programs.pq_cut", cut_fn, cut_pointers, cut, two_stage.CUT_WARPS))
    return [
        {"kernel": name, "dim": dim, **_compile(fn, types, constants, num_warps=warps)}
        for name, fn, types, constants, warps in launches
    ]


def pq_prepare_rows(dim: int, first: bool) -> list[dict]:
    """PQS's prepare at its default (16 centroids a pair of dimensions, its default training keys, bf16 keys): the
    encoding at ``dim``, and the k-means, which no head dim changes (a program reads its sub-space's two coordinates),
    with the first."""
    import triton

    from oa_plugins.selectors import pq_programs
    from oa_plugins.selectors.pq import PQSConfig

    M = dim // 2
    block_m, block_dims = pq_programs.blocks(M, 2)
    strides = dict(sk_b="i64", sk_h="i64", sk_n="i64")
    encode = dict(M=M, DIMS=2, W=M // 2, PACKED=True, BLOCK_K=pq_programs.encode_keys(M), BLOCK_M=block_m)
    encode["BLOCK_DIMS"] = block_dims
    launches = [
        ("pq_programs._pq_encode", pq_programs._pq_encode, dict(KEYS="*bf16", CENT="*fp32", CODES="*u8"), encode, 4)
    ]
    if first:
        train = dict(DIMS=2, BLOCK_DIMS=block_dims, BLOCK_N=triton.next_power_of_2(PQSConfig().train))
        pointers = dict(KEYS="*bf16", POS="*i64", CHOSEN="*i8", CENT="*fp32")
        launches.append(("pq_programs._pq_train", pq_programs._pq_train, pointers, train, pq_programs.TRAIN_WARPS))
    return [
        {"kernel": name, "dim": dim, **_compile(fn, {**strides, **types}, constants, num_warps=warps)}
        for name, fn, types, constants, warps in launches
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256], help="head dims (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(
            "kernel_resources: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)", file=sys.stderr
        )
        return 2
    rows = measure(args.dims)
    import triton

    text = json.dumps(
        {
            "target": "sm_90 (H100/H200)",
            "triton": triton.__version__,
            "shared_limit": SHARED_LIMIT,
            "stack_limit": STACK_LIMIT,
            "command": " ".join(["python", *sys.argv]),
            "rows": rows,
        },
        indent=1,
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(row["fits"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
