"""PQS's scores and shortlist in one CUDA launch on sm_90+ (``pq_shortlist.cu``), and Triton's ``exact_logits`` after
it: the fused step's ``pq_scores``, ``pq_cut`` and ``pq_list`` as one thread-block cluster per (batch row, KV head),
the scores kept in the blocks' shared memory between the phases. Same outputs as the three Triton launches
(``TwoStage.pq_shortlist``): each selection row's scores with its listed positions boxed, its shortlist in position
order with the exact logits, its length, cut key and ties at the cut (``two_stage.Listing``; the segments' places are
not written: only ``pq_list`` reads them).

The source is compiled by nvcc at first use for the device's architecture into the cache that the CPU's compiled
selection uses (``oa_core.ops.native.compiled``; ``$OA_NATIVE_CACHE``), then loaded with ctypes, and launched on the
current stream (so a CUDA graph captures it). Where it cannot run — no nvcc, a GPU before sm_90 (no clusters), a
shape the kernel does not take, ``OA_CUDA=0`` — the step keeps the Triton launches, and ``FusedStep.shortlist_note``
says why.

The scores' sums run in another order than Triton's (sub-spaces in sequence), so a score within float rounding of the
cut may fall the other way. ``tests/test_pq_shortlist_cuda.py`` checks the kernel on a GPU against Triton's launches
and torch (``listing_faults``); ``benchmarks/kernel_h200.py`` checks the step's rows against the reference pipeline
and times the step both ways; ``benchmarks/studies/pq_shortlist_phases.py`` times the kernel's phases."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

from oa_core.ops import native
from oa_plugins.selectors.pq import packed

SOURCE = Path(__file__).with_name("pq_shortlist.cu")
MAX_HEADS = 8  # the kernel's register arrays: query heads per KV head
STATIC_SMEM = 1024  # the kernel's own shared arrays (at most 512 bytes: ptxas -v), with room
CLUSTER_SIZES = (8, 16)  # blocks a cluster, the smallest that fits (8 the fastest at 16K–32K on an H100)
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# ``oa_pq_shortlist``'s parameters in the .cu's order: pointers (tensors' data and the stream), ints, the scale.
# ``launch`` passes them by name, and tests/test_pq_shortlist_cuda.py holds this list to the source's signature, so
# that the two cannot drift apart where no GPU runs the kernel (CI).
POINTERS = ("tables", "codes", "length", "start", "density", "multiple", "scores", "listed", "counts", "cut", "ties")
INTS = ("B", "Hkv", "GS", "G", "M", "CC", "W", "packed", "local", "cap", "fixed", "tokens", "L")
SIGNATURE: tuple[tuple[str, type[ctypes.c_void_p] | type[ctypes.c_int] | type[ctypes.c_float]], ...] = (
    *((name, ctypes.c_void_p) for name in POINTERS),
    *((name, ctypes.c_int) for name in INTS),
    ("scale", ctypes.c_float),
    ("CL", ctypes.c_int),
    ("stop", ctypes.c_int),
    ("stream", ctypes.c_void_p),
)


def launch_names() -> list[str]:
    """The launches ``launch`` makes (``FusedStep.launch_names``)."""
    return ["pq_shortlist", "exact_logits"]


def nvcc() -> str | None:
    """``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``'s), else the one on the PATH."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


@functools.cache
def library(capability: tuple[int, int]) -> ctypes.CDLL | str:
    """The kernel compiled for ``capability`` and loaded, or why it cannot be (a string)."""
    compiler = nvcc()
    if compiler is None:
        return "no nvcc found (set CUDA_HOME, or put nvcc on the PATH)"
    arch = f"{capability[0]}{capability[1]}"
    command = [compiler, "-O3", "-shared", "-Xcompiler", "-fPIC", f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    try:
        note = f"compiling the CUDA shortlist for sm_{arch} with nvcc (once per machine: about a quarter minute)"
        lib = ctypes.CDLL(str(native.compiled("oa_pq_shortlist", SOURCE.read_text(), ".cu", command, note)))
    except (OSError, RuntimeError, native.subprocess.SubprocessError) as exc:
        return f"the CUDA shortlist did not build: {exc}"
    lib.oa_pq_shortlist_smem.restype = ctypes.c_size_t
    lib.oa_pq_shortlist_smem.argtypes = [ctypes.c_int] * 6
    lib.oa_pq_shortlist.restype = ctypes.c_int
    lib.oa_pq_shortlist.argtypes = [kind for _, kind in SIGNATURE]
    lib.oa_shared_memory_limit.restype = ctypes.c_int
    lib.oa_shared_memory_limit.argtypes = [ctypes.c_int]
    return lib


@functools.cache
def cluster_size(heads: int, rows: int, M: int, CC: int, capacity: int, device: torch.device) -> int | None:
    """The blocks a cluster for a (batch row, KV head) of ``capacity`` positions, ``rows`` selection rows of
    ``heads`` query heads in all: the first of ``CLUSTER_SIZES`` whose block's shared memory fits the device; None
    where none does, or where the kernel's registers do not take the heads."""
    if heads > MAX_HEADS:
        return None
    lib = library(torch.cuda.get_device_capability(device))
    if isinstance(lib, str):
        return None
    limit = lib.oa_shared_memory_limit(device.index if device.index is not None else torch.cuda.current_device())
    limit -= STATIC_SMEM
    return next(
        (size for size in CLUSTER_SIZES if lib.oa_pq_shortlist_smem(heads, rows, M, CC, capacity, size) <= limit),
        None,
    )


def unavailable_reason(state) -> str | None:
    """Why the CUDA shortlist cannot serve this ``StaticState``'s fused step (None: it can, for a group that
    ``cluster_size`` takes). Builds the library on a first call: call it outside any capture."""
    if os.environ.get("OA_CUDA", "1") == "0":
        return "OA_CUDA=0"
    device = state.length.device
    if device.type != "cuda":
        return "not a CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        return f"sm_{capability[0]}{capability[1]}: thread-block clusters need sm_90"
    codes, (M, CC) = state.index.codes, state.index.centroids.shape[2:4]
    W = codes.shape[-1]
    if W % 4 or (M // 2 if packed(CC) else M) != W or codes.data_ptr() % 16:
        return f"{M} codes in {W} bytes a key (CUDA shortlist: whole bytes, a multiple of 4, aligned)"
    if any(t.dtype != torch.int64 for t in (state.start, state.length)):
        return "int32 bookkeeping (CUDA shortlist: int64)"
    lib = library(capability)
    return lib if isinstance(lib, str) else None


def group_reason(state, heads: int, rows: int) -> str | None:
    """Why the CUDA shortlist cannot take a group of ``heads`` query heads in ``rows`` selection rows."""
    M, CC = state.index.centroids.shape[2:4]
    if cluster_size(heads, rows, M, CC, state.capacity, state.length.device) is None:
        return (
            f"{heads} query heads a KV head over {state.capacity:,} positions (CUDA shortlist: at most "
            f"{MAX_HEADS} heads, and a cluster's shared memory)"
        )
    return None


def call_arguments(arguments: dict) -> list:
    """``oa_pq_shortlist``'s arguments by name → in ``SIGNATURE``'s order, each as its ctypes type; ValueError where a
    name is missing or unknown."""
    names = [name for name, _ in SIGNATURE]
    if set(arguments) != set(names):
        missing, unknown = sorted(set(names) - set(arguments)), sorted(set(arguments) - set(names))
        raise ValueError(f"CUDA shortlist's arguments: missing {missing}, unknown {unknown}")
    return [kind(arguments[name]) for name, kind in SIGNATURE]


def launch(
    two_stage,
    state,
    tables: Tensor,
    scores: Tensor,
    keys: Tensor,
    query: Tensor,
    budget_args: tuple,
    Gs: int,
    G: int,
    stop: int = 0,
):
    """The scores into ``scores`` ``[rows, capacity]`` (listed ones boxed) and the shortlist (``two_stage.Listing``),
    its exact logits by Triton's ``exact_logits`` in a second launch; ``unavailable_reason`` and ``group_reason`` said
    None. ``stop`` (a study's knob): end after the scores (1), the cut (2), the listing without the exact logits
    (3)."""
    from oa_plugins.kernels.two_stage import PQ_SEGMENT

    if keys.dtype not in DTYPES or query.dtype != keys.dtype:
        raise ValueError(f"CUDA shortlist: keys {keys.dtype}, query {query.dtype} (one of float32, float16, bfloat16)")
    if not all(t.is_contiguous() for t in (tables, scores)) or keys.stride(-1) != 1:
        raise ValueError("CUDA shortlist: the tables and scores contiguous, the keys' rows dense (its layout)")
    lib = library(torch.cuda.get_device_capability(scores.device))
    assert not isinstance(lib, str)  # unavailable_reason said it built
    rows, cap = scores.shape
    B, H = tables.shape[:2]
    M, CC = tables.shape[-2:]
    codes = state.index.codes
    listing = two_stage.listing(rows, cap, scores.device, PQ_SEGMENT)
    length, start, density, fixed, tokens = budget_args
    size = cluster_size(Gs * G, Gs, M, CC, cap, scores.device)
    assert size is not None  # group_reason said None
    tensors = {
        "tables": tables,
        "codes": codes,
        "length": length,
        "start": start,
        "density": density,
        "multiple": two_stage.multiple_t,
        "scores": scores,
        "listed": listing.listed,
        "counts": listing.counts,
        "cut": listing.cut,
        "ties": listing.ties,
    }
    arguments = {name: tensor.data_ptr() for name, tensor in tensors.items()}
    arguments.update(B=B, Hkv=H, GS=Gs, G=G, M=M, CC=CC, W=codes.shape[-1], packed=int(packed(CC)))
    arguments.update(local=state.pipeline.spec.local, cap=cap, fixed=fixed, tokens=tokens, L=listing.listed.shape[1])
    arguments.update(scale=state.scale, CL=size, stop=stop if stop in (1, 2) else 0)
    arguments["stream"] = torch.cuda.current_stream(scores.device).cuda_stream
    with torch.cuda.device(scores.device):  # the library's runtime launches on the thread's current device
        error = lib.oa_pq_shortlist(*call_arguments(arguments))
    if error:
        raise RuntimeError(f"CUDA shortlist: launch failed (cudaError {error})")
    if stop == 0:
        two_stage.exact_logits(listing, scores, keys, query, state.scale, Gs, G, box=False)  # (boxed already)
    return listing
