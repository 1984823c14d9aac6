"""Transfers from one process to another on the same host through one segment of shared
memory, mapped once and reused by every transfer between them, one transfer at a time, in
the order the receiver asks for them.

A KV transfer between replicas on one host moves tens of megabytes a layer at a time.
Through gloo every byte crosses the loopback socket, copied into the kernel and out. A
file per transfer costs more still: the kernel zeroes, maps and frees its fresh pages
each time (docs/benchmarks/2026-12-06-cpu-2core.md). A channel's pages are set up once;
the sender packs each layer straight into a slot and the receiver places it from there.

The receiver drives: it asks for one transfer (its id, under a fresh sequence number),
and the sender of that transfer, waiting for the ask, then fills slots in turn while the
receiver empties them. A transfer the receiver never asks for is never written, so pulls
may come in any order and an abandoned one leaves nothing behind in the segment. Every
count the sender posts carries the sequence number of the ask it answers, so a sender
that answers late (its receiver gave up and asked for another) is ignored.

Layout: on cache lines of their own, the receiver's ask (transfer id, then sequence
number), the sender's posted count, the receiver's taken count (each sequence << 32 |
count), the sender's "attached" and "abandoned" (the sequence it gave up), then
`num_slots` slots of `slot_bytes`. Stores are ordered on x86-64 (TSO), so a side that
sees a count also sees the bytes written before it (`shm_allreduce.supported` decides
where channels are used). The receiver creates the segment; its name goes as soon as the
sender has mapped it, so only a receiver killed before that leaves a file behind, which
the process that named the run removes (`sweep`).
"""

from __future__ import annotations

import glob
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

from meshserve.parallel.comm.shm_names import SHM_DIR
from meshserve.parallel.comm.spin_wait import spin_until

_LINE = 64
_TID, _SEQ, _POSTED, _TAKEN, _ATTACHED, _ABANDONED = (i * _LINE for i in range(6))
_HEADER = 6 * _LINE
_COUNT = (1 << 32) - 1

SLOT_BYTES = 8 << 20
"""Bytes a slot holds: a bigger layer goes a slot-sized chunk at a time."""

NUM_SLOTS = 3

POLL_S = 2e-4
"""How often a side looks for the other's segment to appear."""


class ChannelError(RuntimeError):
    """The other side did not come in time, or gave up."""


def _stamp(seq: int, count: int) -> int:
    return (seq << 32) | count


class ShmChannel:
    """One direction between two processes: `receiver` on one side, `sender` on the other,
    each named by the same `path`."""

    def __init__(self, path: str, buf: mmap.mmap, num_slots: int, slot_bytes: int) -> None:
        self.path, self._buf = path, buf
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self._flag = {at: np.ndarray((1,), dtype=np.int64, buffer=buf, offset=at)
                      for at in (_TID, _SEQ, _POSTED, _TAKEN, _ATTACHED, _ABANDONED)}
        self._slots = torch.frombuffer(buf, dtype=torch.uint8, offset=_HEADER,
                                       count=num_slots * slot_bytes)
        self.lock = threading.Lock()
        """One transfer at a time on this side."""

    @staticmethod
    def footprint(num_slots: int = NUM_SLOTS, slot_bytes: int = SLOT_BYTES) -> int:
        """A segment's bytes."""
        return _HEADER + num_slots * slot_bytes

    @classmethod
    def receiver(cls, path: str, num_slots: int = NUM_SLOTS,
                 slot_bytes: int = SLOT_BYTES) -> ShmChannel:
        """The receiving side: the segment, written under a temporary name and renamed, so
        the sender never maps a short file; its pages reserved and touched once."""
        size = cls.footprint(num_slots, slot_bytes)
        tmp = f"{path}.new"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve the pages now: on a full tmpfs, ftruncate alone would succeed and
            # the first write into the hole would kill the process with SIGBUS.
            os.posix_fallocate(fd, 0, size)
            buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            np.ndarray((1,), dtype=np.int64, buffer=buf, offset=_TID)[0] = -1  # no ask yet
            os.rename(tmp, path)  # (only then may a sender map it)
        except OSError:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        return cls(path, buf, num_slots, slot_bytes)

    @classmethod
    def sender(cls, path: str, deadline: float, what: str, num_slots: int = NUM_SLOTS,
               slot_bytes: int = SLOT_BYTES) -> ShmChannel:
        """The sending side: wait until `deadline` (time.monotonic) for the receiver's
        segment, map it, say so (the receiver then removes its name)."""
        size = cls.footprint(num_slots, slot_bytes)
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
                break
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise ChannelError(f"{what}: the receiver's channel {path} did not "
                                       "appear in time") from None
                time.sleep(POLL_S)
        try:
            if os.fstat(fd).st_size != size:
                raise ChannelError(f"{what}: channel {path} has {os.fstat(fd).st_size} "
                                   f"bytes, this side expects {size}")
            buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        channel = cls(path, buf, num_slots, slot_bytes)
        channel._flag[_ATTACHED][0] = 1
        return channel

    def unlink_once_attached(self) -> None:
        """(Receiver) Remove the segment's name once the sender has mapped it."""
        if self._flag[_ATTACHED][0]:
            self.unlink()

    def unlink(self) -> None:
        for name in (self.path, f"{self.path}.new"):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass

    def chunks(self, sizes: Sequence[int]) -> list[tuple[int, int, int]]:
        """Each transfer part of `sizes` bytes cut into slot-sized chunks: (part, start,
        stop) in order."""
        return [(i, a, min(a + self.slot_bytes, n)) for i, n in enumerate(sizes)
                for a in range(0, n, self.slot_bytes)]

    def _slot(self, c: int, nbytes: int) -> torch.Tensor:
        start = (c % self.num_slots) * self.slot_bytes
        return self._slots[start:start + nbytes]

    def _wait(self, ready: Callable[[], bool], deadline: float, what: str,
              check: Callable[[], None] = lambda: None) -> None:
        if not spin_until(ready, max(0.0, deadline - time.monotonic()), check):
            check()
            raise ChannelError(f"{what}: timed out")

    # receiver
    def receive(self, transfer_id: int, sizes: Sequence[int], deadline: float, what: str,
                place: Callable[[int, int, torch.Tensor], None]) -> None:
        """Ask for transfer `transfer_id` (parts of `sizes` bytes) and hand each chunk, as
        it lands, to `place(part, start, bytes)` (a view of the slot: copy it out)."""
        self._acquire(deadline, what)
        try:
            seq = int(self._flag[_SEQ][0]) + 1
            self._flag[_TAKEN][0] = _stamp(seq, 0)
            self._flag[_SEQ][0] = seq
            self._flag[_TID][0] = transfer_id  # the ask: an id seen implies its sequence

            def gave_up() -> None:
                if int(self._flag[_ABANDONED][0]) == seq:
                    raise ChannelError(f"{what}: the sender gave up")

            try:
                for c, (part, a, b) in enumerate(self.chunks(sizes)):
                    posted = _stamp(seq, c + 1)
                    self._wait(partial(_reached, self._flag, _POSTED, posted),
                               deadline, f"{what}: chunk {c + 1}", gave_up)
                    place(part, a, self._slot(c, b - a))
                    self._flag[_TAKEN][0] = _stamp(seq, c + 1)
            finally:  # answered or not, this ask is over: a late sender is ignored
                self._flag[_TID][0] = -1
                self.unlink_once_attached()
        finally:
            self.lock.release()

    def _acquire(self, deadline: float, what: str) -> None:
        if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ChannelError(f"{what}: another transfer held the channel too long")

    # sender
    def send(self, transfer_id: int, sizes: Sequence[int], deadline: float, what: str,
             fill: Callable[[int, int, torch.Tensor], None]) -> None:
        """Wait for the receiver to ask for `transfer_id`, then have `fill(part, start,
        slot)` write each chunk straight into its slot, as the receiver frees them."""
        def asked() -> int | None:
            """The sequence number of the receiver's ask for this transfer, if it is the
            ask now (the receiver writes the sequence number, then the id)."""
            seq = int(self._flag[_SEQ][0])
            if int(self._flag[_TID][0]) == transfer_id and int(self._flag[_SEQ][0]) == seq:
                return seq
            return None

        self._wait(lambda: asked() is not None, deadline, f"{what}: never asked for")
        self._acquire(deadline, what)
        try:
            seq = asked()
            if seq is None:  # asked, then given up on, while another sender held the lock
                raise ChannelError(f"{what}: the receiver gave up")

            def still_asked() -> None:
                if asked() != seq:
                    raise ChannelError(f"{what}: the receiver gave up")

            try:
                for c, (part, a, b) in enumerate(self.chunks(sizes)):
                    free = _stamp(seq, max(0, c + 1 - self.num_slots))  # its slot's last use
                    self._wait(partial(_reached, self._flag, _TAKEN, free),
                               deadline, f"{what}: slot for chunk {c + 1}", still_asked)
                    still_asked()
                    fill(part, a, self._slot(c, b - a))
                    self._flag[_POSTED][0] = _stamp(seq, c + 1)
            except Exception:
                self._flag[_ABANDONED][0] = seq
                raise
        finally:
            self.lock.release()

    def close(self) -> None:
        """Unmap, unless a view is still alive (then its last reference does)."""
        self._flag.clear()
        del self._slots
        try:
            self._buf.close()
        except BufferError:
            pass


def sweep(prefix: str) -> int:
    """Remove the files under SHM_DIR whose names start with `prefix` (what killed
    processes of a run left); how many went."""
    n = 0
    for name in glob.glob(f"{SHM_DIR}/{glob.escape(prefix)}*"):
        try:
            os.unlink(name)
            n += 1
        except FileNotFoundError:
            pass
    return n


def _reached(flag: dict[int, np.ndarray], field: int, stamp: int) -> bool:
    """Whether the channel's `field` counter has reached `stamp`."""
    return int(flag[field][0]) >= stamp
