"""AllReduce of CPU tensors through shared memory, for TP ranks on one machine.

gloo's AllReduce costs about 0.6 ms per call here, which at TP=2 is paid twice per layer
per step. Ranks on one host can instead each copy their tensor into a shared segment,
wait until every rank has posted, and each sum all the posted copies itself (in rank
order, so every rank gets the same bits).

Layout of the segment: `size` int64 sequence flags, then two banks of `size` slots of
`slot_bytes` each. Call number s writes bank s % 2 and then raises its flag to s; a rank
reuses a bank only two calls later, after every rank has posted the call in between, so
after every rank has finished reading it. Stores are ordered on x86-64 (TSO), so a rank
that sees a flag also sees the data written before it; on other processors this class is
not used. The creating rank unlinks the segment as soon as everyone has mapped it, so
nothing is left behind however the processes end.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

SLOT_BYTES = 4 << 20
"""Largest tensor (bytes) that goes through shared memory; bigger ones use gloo."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

SPINS_BEFORE_YIELD = 64
"""Polls of the flags before each yield of the core while waiting for other ranks."""

SPINS_BEFORE_SLEEP = 1024
"""Polls after which a waiting rank sleeps between polls (BACKOFF_S): with more ranks than
cores, a spinning rank would take the core from the rank it waits for."""

BACKOFF_S = 50e-6


SHM_DIR = "/dev/shm"
"""Where the segment's file lives (Linux's memory-backed file system)."""


def supported() -> bool:
    """Whether this processor orders stores as the flag protocol needs (x86-64) and the
    memory-backed file system is there."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


class ShmAllReduce:
    """Sum over the ranks of `group` (all on this host) of tensors up to `slot_bytes`.

    Built by every rank of the group together (collective: it broadcasts the segment's
    name and waits until every rank has mapped it)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, *,
                 timeout: timedelta | None, slot_bytes: int = SLOT_BYTES) -> None:
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.timeout_s = timeout.total_seconds() if timeout is not None else None
        self.seq = 0
        header = 8 * size
        total = header + 2 * size * slot_bytes
        paths = [f"{SHM_DIR}/meshserve-ar-{uuid.uuid4().hex[:16]}" if rank == 0 else None]
        if rank == 0:
            fd = os.open(paths[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, total)
        dist.broadcast_object_list(paths, src=dist.get_global_rank(group, 0), group=group)
        if rank != 0:
            fd = os.open(paths[0], os.O_RDWR)
        # A plain file mapping: no multiprocessing resource tracker to unlink or warn about it.
        self.buf = mmap.mmap(fd, total)
        os.close(fd)
        dist.barrier(group=group)  # everyone has mapped it
        if rank == 0:
            os.unlink(paths[0])  # the mappings live on; the name is gone
        self.flags = np.ndarray((size,), dtype=np.int64, buffer=self.buf)
        self._bytes = torch.frombuffer(self.buf, dtype=torch.uint8, count=total - header,
                                       offset=header)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` can go through shared memory (CPU, contiguous, small, float)."""
        return (x.device.type == "cpu" and x.dtype in DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.slot_bytes)

    def _slot(self, bank: int, rank: int, x: torch.Tensor) -> torch.Tensor:
        start = (bank * self.size + rank) * self.slot_bytes
        n = x.numel() * x.element_size()
        return self._bytes[start:start + n].view(x.dtype).view(x.shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place (`fits(x)` must hold)."""
        self.seq += 1
        seq, bank = self.seq, self.seq % 2
        self._slot(bank, self.rank, x).copy_(x)
        self.flags[self.rank] = seq
        self._wait(seq)
        parts = [self._slot(bank, r, x) for r in range(self.size)]  # rank order everywhere
        if self.size == 2:
            torch.add(parts[0], parts[1], out=x)
        else:
            torch.sum(torch.stack(parts), dim=0, out=x)
        return x

    def _wait(self, seq: int) -> None:
        flags = self.flags
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        spins = 0
        while (flags < seq).any():
            spins += 1
            if spins > SPINS_BEFORE_SLEEP:
                time.sleep(BACKOFF_S)
            elif spins % SPINS_BEFORE_YIELD == 0:
                time.sleep(0)
            if (spins % SPINS_BEFORE_YIELD == 0 and deadline is not None
                    and time.monotonic() > deadline):
                late = [r for r in range(self.size) if flags[r] < seq]
                raise RuntimeError(
                    f"shared-memory all_reduce #{seq} timed out after {self.timeout_s} s: "
                    f"TP ranks {late} did not arrive (dead or hung)")

    def close(self) -> None:
        """Drop this process's mapping."""
        del self.flags
        del self._bytes
        self.buf.close()
