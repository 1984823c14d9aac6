"""Host memory tuned for CPU inference: glibc malloc keeps large step temporaries in the heap,
and weights and KV caches live on 2 MiB pages.

glibc serves allocations above M_MMAP_THRESHOLD (at most 32 MiB by default) with a fresh
mmap and unmaps them on free, so every step's large temporaries (gathered KV, prefill
activations) fault their pages in again. Raising the threshold (and the trim threshold,
so freed memory is kept) lets those buffers be reused.

Decode streams every weight and the sequences' KV blocks from memory each step. On 4 KiB
pages that walk misses the TLB every 4 KiB; on transparent huge pages (asked for with
madvise, which is what most distributions allow by default) it misses once per 2 MiB
(figures: docs/benchmarks/2026-11-30-cpu-2core.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import sys

import torch

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 30
"""Allocations up to 1 GiB come from the heap; up to 2 GiB of freed heap is kept."""

_done = False


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where not glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, 2 * THRESHOLD_BYTES))
    except (OSError, AttributeError):  # musl or no libc: leave the allocator alone
        return False
    _done = ok
    return ok


HUGE_PAGE_BYTES = 2 << 20
"""A transparent huge page on x86-64 and most arm64 kernels; smaller tensors stay put."""


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros (anonymous memory) on a mapping of its own,
    2 MiB-aligned and madvise(MADV_HUGEPAGE)d before first touch, so the kernel backs it with
    huge pages where it can (else with small ones: same tensor, no error); its pages are
    faulted in on first touch. The mapping is unmapped when the last tensor on it is gone."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes,
                            offset=-addr % HUGE_PAGE_BYTES)  # holds `buf`
    return flat.view(dtype).view(shape)


def to_huge_pages(module: torch.nn.Module) -> int:
    """Move each CPU parameter and buffer whose storage is at least a huge page onto
    huge_page_empty memory (same values, shape, strides; tensors sharing a storage, tied
    weights, keep sharing it); returns how many storages moved."""
    moved: dict[int, torch.UntypedStorage] = {}
    tensors = [*module.parameters(), *module.buffers()]
    for t in tensors:
        old = t.untyped_storage()
        if t.device.type != "cpu" or old.nbytes() < HUGE_PAGE_BYTES:
            continue
        key = old.data_ptr()
        if key not in moved:
            new = huge_page_empty((old.nbytes(),), torch.uint8)
            new.copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (old.nbytes(),), (1,)))
            moved[key] = new.untyped_storage()
        t.data = torch.empty(0, dtype=t.dtype).set_(moved[key], t.storage_offset(), t.shape,
                                                    t.stride())
    return len(moved)
