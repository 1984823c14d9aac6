"""The tensor-parallel group a sharded layer talks to, passed to it explicitly.

Every TP collective goes through this object, so a faster transport (a shared-memory
CPU AllReduce, say) can replace torch.distributed here without touching the layers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from datetime import timedelta

import torch
import torch.distributed as dist

from meshserve.parallel.comm.shm_allreduce import ShmAllReduce


@dataclass
class CommCounters:
    """Collectives this rank took part in, and the bytes it contributed to them."""

    num_all_reduce: int = 0
    all_reduce_bytes: int = 0
    num_gather: int = 0
    gather_bytes: int = 0
    comm_s: float = 0.0
    """Seconds this rank spent in those calls (waiting for slower ranks included; with NCCL
    only the launch, since the collective runs asynchronously on the stream)."""

    def snapshot(self) -> CommCounters:
        """A copy, for per-step differences."""
        return CommCounters(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: CommCounters) -> CommCounters:
        return CommCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                               for f in fields(self)})


@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's place in its TP group; `group` is None when running unsharded."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    counters: CommCounters = field(default_factory=CommCounters, compare=False, repr=False)
    """Collectives issued at size > 1 (size 1 communicates nothing and counts nothing)."""
    timeout: timedelta | None = field(default=None, compare=False)
    """Longest wait for the other ranks (gloo); None leaves it to the process group (NCCL)."""
    shm: ShmAllReduce | None = field(default=None, compare=False, repr=False)
    """Shared-memory AllReduce for CPU tensors when every rank of the group is on this
    host; tensors it does not take go through `group`."""

    def __post_init__(self) -> None:
        assert self.size >= 1 and 0 <= self.rank < self.size, (self.rank, self.size)
        assert self.size == 1 or self.group is not None, "a TP group of size > 1 needs a group"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place (no-op at size 1)."""
        if self.size > 1:
            t0 = time.perf_counter()
            self.counters.num_all_reduce += 1
            self.counters.all_reduce_bytes += x.numel() * x.element_size()
            if self.shm is not None and self.shm.fits(x):
                self.shm.all_reduce(x)
            elif self.timeout is None:
                dist.all_reduce(x, group=self.group)
            else:
                self._wait(dist.all_reduce(x, group=self.group, async_op=True))
            self.counters.comm_s += time.perf_counter() - t0
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (no-op at size 1)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim` on TP rank `dst`; None on the others."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        self.counters.num_gather += 1
        self.counters.gather_bytes += x.numel() * x.element_size()
        x = x.contiguous()
        if self.shm is not None and self.shm.fits_gather(x):
            out = self.shm.gather(x, dim, dst)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == dst else None
            self._wait(dist.gather(x, parts, group=self.group, group_dst=dst, async_op=True))
            out = torch.cat(parts, dim=dim) if parts is not None else None
        self.counters.comm_s += time.perf_counter() - t0
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """TP rank `src`'s `x` into every rank's `x`, in place (no-op at size 1). On NCCL the
        current stream waits for it, not the host."""
        if self.size > 1:
            self._wait(dist.broadcast(x, group=self.group, group_src=src, async_op=True))
        return x

    def _wait(self, work: dist.Work | None) -> None:
        assert work is not None
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    def divide(self, n: int, what: str) -> int:
        """n / size, with a clear error when it doesn't divide."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {self.size}")
        return n // self.size


SINGLE = TensorParallelGroup()
