"""One message of known parts from one process to another on the same host, through a
file in shared memory: the sender creates it and writes it part by part, and the receiver
reads each part as soon as it is written.

A KV transfer between replicas on one host moves tens of megabytes in a few parts (a
layer each). Through gloo every byte crosses the loopback socket: copied into the kernel
and out again, on top of packing and placing. Through a parcel the sender packs each part
straight into the file and the receiver places it from there.

Layout of the file: three int64 flags, each on a cache line of its own (the receiver's
"attached", the sender's count of parts written, the sender's "abandoned"), then the
parts back to back, each starting on a cache line. The sender writes the file under a
temporary name and renames it once it has its full size, so a receiver never maps a short
file. Both sides know the parts' sizes beforehand; the receiver checks the file's size
against them. Stores are ordered on x86-64 (TSO), so a receiver that sees a count also
sees the bytes written before it (`shm_allreduce.supported` decides where parcels are
used).

The file's name goes as soon as the receiver has mapped it (the receiver removes it, and
the sender does once it sees it attached); the memory goes with the last mapping. A sender
whose receiver never comes removes the file when its wait times out. Only a sender killed
between creating the file and its receiver's attach leaves a file behind; the process
that named the transfers removes its own run's (`sweep`).
"""

from __future__ import annotations

import glob
import mmap
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from meshserve.parallel.comm.shm_allreduce import SHM_DIR
from meshserve.parallel.comm.spin_wait import spin_until

_LINE = 64
_HEADER = 3 * _LINE
_ATTACHED, _WRITTEN, _ABANDONED = 0, _LINE, 2 * _LINE

POLL_S = 2e-4
"""How often a receiver looks for a parcel's file to appear."""


class ParcelError(RuntimeError):
    """The other side did not come, gave up, or sent a parcel of another size."""


def _offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each part's offset in the file, and the file's size."""
    out, at = [], _HEADER
    for size in sizes:
        out.append(at)
        at += -(-size // _LINE) * _LINE
    return out, max(at, _HEADER)


class ShmParcel:
    """A parcel of parts of `sizes` bytes at `path`: `create` on the sending side,
    `attach` on the receiving one."""

    def __init__(self, path: str, sizes: Sequence[int], buf: mmap.mmap) -> None:
        self.path, self.sizes, self._buf = path, list(sizes), buf
        self._offsets, _ = _offsets(sizes)
        self._flags = {at: np.ndarray((1,), dtype=np.int64, buffer=buf, offset=at)
                       for at in (_ATTACHED, _WRITTEN, _ABANDONED)}

    @classmethod
    def create(cls, path: str, sizes: Sequence[int]) -> ShmParcel:
        """The sender's side: the file, full size, under its name."""
        _, total = _offsets(sizes)
        tmp = f"{path}.new"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve the pages now: on a full tmpfs, ftruncate alone would succeed and
            # the first write into the hole would kill the process with SIGBUS.
            os.posix_fallocate(fd, 0, total)
            buf = mmap.mmap(fd, total)
            os.rename(tmp, path)
        except OSError:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        return cls(path, sizes, buf)

    @classmethod
    def attach(cls, path: str, sizes: Sequence[int], deadline: float,
               what: str) -> ShmParcel:
        """The receiver's side: wait until `deadline` (time.monotonic) for the file, map
        it, say so and remove its name."""
        _, total = _offsets(sizes)
        fd = None
        while fd is None:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise ParcelError(f"{what}: the sender did not begin in time") from None
                time.sleep(POLL_S)
        try:
            size = os.fstat(fd).st_size
            if size != total:
                raise ParcelError(f"{what}: the sender's parcel has {size} bytes, this side "
                                  f"expects {total} ({len(sizes)} parts)")
            buf = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        parcel = cls(path, sizes, buf)
        parcel._flags[_ATTACHED][0] = 1
        parcel.unlink()
        return parcel

    def part(self, i: int) -> torch.Tensor:
        """Part `i`'s bytes (a view of the file)."""
        if not self.sizes[i]:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._buf, dtype=torch.uint8, count=self.sizes[i],
                                offset=self._offsets[i])

    # sender
    def written(self, n: int) -> None:
        """Parts 0..n-1 are written."""
        self._flags[_WRITTEN][0] = n

    def abandon(self) -> None:
        """The sender gives up: the receiver fails at once instead of at its deadline."""
        self._flags[_ABANDONED][0] = 1

    def wait_attached(self, deadline: float) -> bool:
        """Wait until `deadline` for the receiver to map the file; whether it did."""
        return spin_until(lambda: bool(self._flags[_ATTACHED][0]),
                          max(0.0, deadline - time.monotonic()))

    # receiver
    def wait_part(self, i: int, deadline: float, what: str) -> torch.Tensor:
        """Part `i` once the sender has written it (until `deadline`)."""

        def abandoned() -> None:
            if self._flags[_ABANDONED][0]:
                raise ParcelError(f"{what}: the sender gave up")

        if not spin_until(lambda: int(self._flags[_WRITTEN][0]) > i,
                          max(0.0, deadline - time.monotonic()), abandoned):
            abandoned()
            raise ParcelError(f"{what}: part {i + 1} of {len(self.sizes)} did not come "
                              "in time")
        return self.part(i)

    # both
    def unlink(self) -> None:
        """Remove the file's name (mappings stay)."""
        for name in (self.path, f"{self.path}.new"):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap, unless a view of a part is still alive (then its last reference does)."""
        self._flags.clear()
        try:
            self._buf.close()
        except BufferError:
            pass


def sweep(prefix: str) -> int:
    """Remove what is left of the parcels whose names start with `prefix` (under
    SHM_DIR): their senders died before their receivers came. How many went."""
    n = 0
    for name in glob.glob(f"{SHM_DIR}/{glob.escape(prefix)}*"):
        try:
            os.unlink(name)
            n += 1
        except FileNotFoundError:
            pass
    return n
