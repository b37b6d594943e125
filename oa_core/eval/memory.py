"""Ranks that share a GPU: each runs out of memory at the others' peaks. The work queue that runs such cells again
(in halves, then alone at the end, then left for a rerun), the retry after the allocator gave its blocks back, and
the peak memory a record reports."""

from __future__ import annotations

from collections import deque

import torch


class WorkQueue:
    """This rank's units of work — (task, length, sample indices) and the cells each still misses — in order, and
    what becomes of cells that run out of memory twice (ranks sharing a GPU run out at one another's peaks): a batch
    of several samples runs again at once as two halves (down to one sample); a one-sample unit's failed cells go to
    the end of the queue once, for when the rank's other work is done, and if they fail again are left for a rerun
    (``skipped``)."""

    def __init__(self, todo: list[tuple]) -> None:
        self.units = deque(todo)
        self.deferred: set[tuple] = set()  # cells already sent to the end once
        self.skipped: list[tuple] = []  # cells left for a rerun

    def __bool__(self) -> bool:
        return bool(self.units)

    def next(self) -> tuple:
        return self.units.popleft()

    def out_of_memory(self, task: str, length: int, indices: tuple[int, ...], failed: list[tuple]) -> str:
        """Queues a unit's ``failed`` cells again as the rule says → what was done, for the log."""
        if len(indices) > 1:
            self.units.extendleft(reversed(split_in_halves(task, length, indices, failed)))
            return "running them again in two halves"
        if failed[0][0] in self.deferred:
            self.skipped += [key for key, *_ in failed]
            return "alone: left for a rerun"
        self.deferred.update(key for key, *_ in failed)
        self.units.append(((task, length, indices), failed))
        return "alone: tried again at the end"


def split_in_halves(task: str, length: int, indices: tuple[int, ...], cells: list[tuple]) -> list[tuple]:
    """A batch's units of work as two of half its samples each, every cell with the samples of its half it misses."""
    middle = (len(indices) + 1) // 2
    units = []
    for half in (indices[:middle], indices[middle:]):
        part = [((*key[:4], half[0]), spec, tuple(i for i in missing if i in half)) for key, spec, missing in cells]
        part = [cell for cell in part if cell[2]]
        if part:
            units.append(((task, length, half), part))
    return units


def retry_after_oom(work, handle, device: torch.device):
    """``work()``; if it runs out of memory (ranks sharing a GPU), once more after the caching allocator gave its free
    blocks back; None if the second try runs out too."""
    for _ in range(2):
        try:
            return work()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not out_of_memory(exc):
                raise
            handle.reset_stats()
            release(device)
    return None


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the GPU ran out of memory: torch's error; the CUDA driver's as Triton reports it when it
    cannot load a kernel ("Triton Error [CUDA]: out of memory": ranks sharing a GPU, whose caching allocators hold
    its memory); or the runtime's ``cudaErrorMemoryAllocation`` as torch raises it outside its allocator ("CUDA
    error: out of memory", a ``torch.AcceleratorError``: ranks under CUDA MPS, 14 of them at batch 8 on an H100)."""
    text = str(exc)
    return (
        isinstance(exc, torch.OutOfMemoryError)
        or "[CUDA]: out of memory" in text
        or "CUDA error: out of memory" in text
    )


def claim_solver(device: torch.device) -> None:
    """cuSOLVER's handle made now, while the GPU has room: QGC's first eigh would make it outside the caching
    allocator, and on a GPU that ranks sharing it have filled that fails as CUSOLVER_STATUS_INTERNAL_ERROR — not an
    out-of-memory error a retry handles."""
    if device.type == "cuda":
        torch.linalg.eigh(torch.eye(2, device=device))


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """The GPU memory allocated at most since ``reset_peak``, GiB (None on the CPU)."""
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None


def release(device: torch.device) -> None:
    """The caching allocator's free blocks back to the device."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
