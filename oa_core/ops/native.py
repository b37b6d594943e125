"""The CPU's selection as a small C++ function, compiled at first use — what the Triton kernel is on CUDA.

On the CPU a decode step's selection is about a hundred small torch ops (sorts and top-ks over a few thousand
scores): on 2 cores about 2 ms per layer and step, a third of a sparse step. One pass in C++ over each (selection
row, cluster) — the cluster's q_b best found with ``std::nth_element`` over its members' order keys, then its
members above that threshold written in position order — does the same work in tens of microseconds.

The source below is compiled once per machine with the system's C++ compiler (``$CXX``, else ``c++``, ``g++`` or
``clang++``; a second or two) into a cache directory (``$OA_NATIVE_CACHE``, else ``~/.cache/openattention``, else
the temporary folder), named by the source's hash, and loaded with ctypes: no torch headers, no build step at
install. Without a compiler ``select`` runs its torch reference (``select_by_sorting``) and says so once;
``OA_NATIVE=0`` chooses the reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

SOURCE = r"""
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

// float32 -> an integer of the same order: the bits, negated magnitude for negative floats (-0.0 and 0.0 tie), as
// oa_core.ops.selection.order_keys; times 2^32 plus (N - 1 - position): unique, and at equal scores the earlier
// position ranks first, as the reference's stable descending sort.
static inline int64_t unique_key(const float* scores, int64_t n, int64_t position) {
    int32_t bits;
    std::memcpy(&bits, scores + position, sizeof bits);
    const int64_t magnitude = bits & 0x7FFFFFFF;
    return (bits < 0 ? -magnitude : magnitude) * 4294967296LL + (n - 1 - position);
}

// Per selection row p and cluster c: the quota's best of the cluster's members (listed in position order), written
// in position order, clusters one after another, then -1 up to width (a row whose quotas sum past width is cut).
extern "C" void oa_select_per_cluster(const float* scores, int64_t rows, int64_t n, const int32_t* members,
                                      int64_t head_stride, int64_t clusters, int64_t slots, const int64_t* counts,
                                      const int64_t* quotas, int64_t rows_per_head, int64_t* out, int64_t width) {
    std::vector<int64_t> keys;
    for (int64_t p = 0; p < rows; ++p) {
        const float* row = scores + p * n;
        const int64_t head = p / rows_per_head;
        int64_t* listed = out + p * width;
        int64_t written = 0;
        for (int64_t c = 0; c < clusters && written < width; ++c) {
            const int32_t* member = members + head * head_stride + c * slots;
            const int64_t size = counts[head * clusters + c];
            const int64_t quota = std::min(quotas[p * clusters + c], size);
            if (quota <= 0) continue;
            if (quota == size) {  // the whole cluster, as listed
                for (int64_t i = 0; i < size && written < width; ++i) listed[written++] = member[i];
                continue;
            }
            keys.resize(size);
            for (int64_t i = 0; i < size; ++i) keys[i] = unique_key(row, n, member[i]);
            std::nth_element(keys.begin(), keys.begin() + (quota - 1), keys.end(), std::greater<int64_t>());
            const int64_t least = keys[quota - 1];  // the quota-th best: every key at or above it is taken
            for (int64_t i = 0; i < size && written < width; ++i)
                if (unique_key(row, n, member[i]) >= least) listed[written++] = member[i];
        }
        for (; written < width; ++written) listed[written] = -1;
    }
}
"""

_library: ctypes.CDLL | None = None
_reason: str | None = None  # why the library is not there, once known
_warned = False


def _cache_dir() -> Path:
    """``$OA_NATIVE_CACHE``, else ``~/.cache/openattention``; the system's temporary folder where that cannot be made
    (a read-only home, as some CI sandboxes have)."""
    if os.environ.get("OA_NATIVE_CACHE"):
        return Path(os.environ["OA_NATIVE_CACHE"])
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "openattention"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.gettempdir()) / f"openattention-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    return folder


def _compiler() -> str | None:
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


def compiled(name: str, source: str, suffix: str, command: list[str], note: str | None = None) -> Path:
    """``source`` compiled by ``command`` (the compiler and its flags: the source file, ``-o`` and the target are
    appended) into the cache folder (``_cache_dir``), named ``name`` and a hash of the source and the command; the
    cached file where it is there already. Compiled into a temporary name, then renamed: ranks that compile at once
    each finish with a whole file. ``note``: said on stderr before a compile (a long one). Raises RuntimeError with
    the compiler's last words where it fails."""
    digest = hashlib.sha256((source + " ".join(command[1:])).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}_{digest}.so"
    if not target.exists():
        if note:
            print(f"openattention: {note}", file=sys.stderr, flush=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            file = Path(work) / f"{name}{suffix}"
            file.write_text(source)
            built = Path(work) / target.name
            done = subprocess.run([*command, str(file), "-o", str(built)], capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"{Path(command[0]).name} failed: {done.stderr.strip()[-500:]}")
            os.replace(built, target)
    return target


def _build() -> ctypes.CDLL:
    """The compiled library, from the cache or compiled now."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install c++/g++/clang++)")
    target = compiled("oa_native", SOURCE, ".cpp", [compiler, "-O3", "-std=c++17", "-shared", "-fPIC"])
    library = ctypes.CDLL(str(target))
    library.oa_select_per_cluster.restype = None
    library.oa_select_per_cluster.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
    ]
    return library


def library() -> ctypes.CDLL | None:
    """The compiled library, built at the first call; None (and one warning saying why) where it cannot be."""
    global _library, _reason, _warned
    if _library is None and _reason is None:
        if os.environ.get("OA_NATIVE", "1") == "0":
            _reason = "OA_NATIVE=0"
        else:
            try:
                _library = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _reason = str(exc)
    if _library is None and not _warned and _reason != "OA_NATIVE=0":
        _warned = True
        warnings.warn(
            f"openattention: the CPU's compiled selection is unavailable ({_reason}); the torch reference "
            "runs instead (the same positions, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
    return _library


def unavailable_reason() -> str | None:
    """Why the compiled CPU selection does not run (None: it does)."""
    return None if library() is not None else _reason


def select_per_cluster(scores: Tensor, members: Tensor, counts: Tensor, quotas: Tensor, width: int) -> Tensor:
    """``oa_core.ops.selection.select`` on CPU tensors, compiled: scores ``[B, Hkv, Gs, T, N]``, members/counts from
    ``cluster_members`` (``[B, Hkv, C, S]`` int32, -1 padded; ``[B, Hkv, C]``), quotas ``[B, Hkv, Gs, T, C]`` →
    positions ``[B, Hkv, Gs, T, min(width, N)]``: each cluster's q_b best in position order, clusters in order, -1
    padded. The library must be there (``library()``)."""
    B, Hkv, Gs, T, N = scores.shape
    C, S = members.shape[-2:]
    if members.dtype != torch.int32 or members.stride()[-2:] != (S, 1) or members.stride(0) != Hkv * members.stride(1):
        members = members.to(torch.int32).contiguous()
    rows, wide = B * Hkv * Gs * T, min(width, N)
    scores = scores.to(torch.float32).reshape(rows, N).contiguous()
    counts = counts.to(torch.int64).contiguous()
    quotas = quotas.to(torch.int64).reshape(rows, C).contiguous()
    out = torch.empty(rows, wide, dtype=torch.int64)
    if rows and wide:
        lib = library()
        assert lib is not None  # the caller checked (above)
        lib.oa_select_per_cluster(
            scores.data_ptr(),
            rows,
            N,
            members.data_ptr(),
            members.stride(1),
            C,
            S,
            counts.data_ptr(),
            quotas.data_ptr(),
            Gs * T,
            out.data_ptr(),
            wide,
        )
    return out.view(B, Hkv, Gs, T, wide)
