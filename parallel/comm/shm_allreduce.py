"""AllReduce and gather of CPU tensors through shared memory, for TP ranks on one machine.

gloo's AllReduce costs a fixed latency per call, paid twice per layer per step at TP > 1
(its figures on the CPU machines: docs/benchmarks/2026-11-30-cpu-2core.md). Ranks on one host can instead each copy their tensor into a shared segment,
wait until every rank has posted, and each sum all the posted copies itself (in rank
order, so every rank gets the same bits).

Layout of the segment: `size` int64 sequence flags, then two banks of `size` slots of
`slot_bytes` each. Call number s writes bank s % 2 and then raises its flag to s; a rank
reuses a bank only two calls later, after every rank has posted the call in between, so
after every rank has finished reading it. Stores are ordered on x86-64 (TSO), so a rank
that sees a flag also sees the data written before it; on other processors this class is
not used. A gather's senders do not wait for the others, so every call first waits until
every rank has posted the call before it (free after an AllReduce): the bank it is about
to write was then read by everyone. A tensor bigger than a slot is summed a slot-sized
piece at a time. The creating rank unlinks the segment as soon as everyone has mapped it,
so nothing is left behind however the processes end.
"""

from __future__ import annotations

import mmap
import os
import platform
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from meshserve.parallel.comm.shm_names import SHM_DIR, shm_path
from meshserve.parallel.comm.spin_wait import spin_until

SLOT_BYTES = 4 << 20
"""Bytes per rank and bank: an AllReduce of a bigger tensor takes several rounds, a gather
of a bigger one goes through gloo."""

MAX_CACHED_VIEWS = 512
"""Slot views kept per (bank, rank, dtype, shape): decode steps repeat the same shapes."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)



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
        self.alive: Callable[[], None] = lambda: None
        """Called while waiting; may raise (a peer died). `watch_peers` gives it once the
        peers' pids are known."""
        header = 8 * size
        total = header + 2 * size * slot_bytes
        paths = [shm_path("ar") if rank == 0 else None]
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
        self._views: dict[tuple[int, int, torch.dtype, torch.Size], torch.Tensor] = {}

    def watch_peers(self, alive: Callable[[], None]) -> None:
        """Call `alive` while waiting on the peers; it raises once one has died, so a dead
        peer fails the next sum at once rather than at its timeout."""
        self.alive = alive

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` can go through shared memory (CPU, contiguous, float); a gather's
        part must also fit in one slot."""
        return x.device.type == "cpu" and x.dtype in DTYPES and x.is_contiguous()

    def fits_gather(self, x: torch.Tensor) -> bool:
        """Whether `gather(x)` goes through shared memory."""
        return self.fits(x) and x.numel() * x.element_size() <= self.slot_bytes

    def _slot(self, bank: int, rank: int, x: torch.Tensor) -> torch.Tensor:
        key = (bank, rank, x.dtype, x.shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= MAX_CACHED_VIEWS:
                self._views.clear()
            start = (bank * self.size + rank) * self.slot_bytes
            n = x.numel() * x.element_size()
            view = self._bytes[start:start + n].view(x.dtype).view(x.shape)
            self._views[key] = view
        return view

    def _post(self, x: torch.Tensor) -> tuple[int, int]:
        """Copy `x` into this rank's slot of the next call's bank and raise the flag."""
        self.seq += 1
        seq, bank = self.seq, self.seq % 2
        self._wait(seq - 1)  # every rank is past the call that last read this bank
        self._slot(bank, self.rank, x).copy_(x)
        self.flags[self.rank] = seq
        return seq, bank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place (`fits(x)` must hold)."""
        max_elems = self.slot_bytes // x.element_size()
        if x.numel() > max_elems:  # slot-sized rounds over the flat tensor
            flat = x.view(-1)
            for start in range(0, flat.numel(), max_elems):
                self._all_reduce(flat[start:start + max_elems])
            return x
        return self._all_reduce(x)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        seq, bank = self._post(x)
        self._wait(seq)
        parts = [self._slot(bank, r, x) for r in range(self.size)]  # rank order everywhere
        if self.size == 2:
            torch.add(parts[0], parts[1], out=x)
        else:
            torch.sum(torch.stack(parts), dim=0, out=x)
        return x

    def gather(self, x: torch.Tensor, dim: int, dst: int) -> torch.Tensor | None:
        """Every rank's `x` (same shape everywhere) concatenated along `dim` on rank `dst`;
        None on the others, which return as soon as their part is posted."""
        seq, bank = self._post(x)
        if self.rank != dst:
            return None
        self._wait(seq)
        return torch.cat([self._slot(bank, r, x) for r in range(self.size)], dim=dim)

    def _wait(self, seq: int) -> None:
        flags = self.flags
        if not spin_until(lambda: not (flags < seq).any(), self.timeout_s, self.alive):
            late = [r for r in range(self.size) if flags[r] < seq]
            raise RuntimeError(
                f"shared-memory all_reduce #{seq} timed out after {self.timeout_s} s: "
                f"TP ranks {late} did not arrive (dead or hung)")

    def close(self) -> None:
        """Drop this process's mapping."""
        self._views.clear()
        del self.flags
        del self._bytes
        self.buf.close()
