"""One-way messages between two processes on one host, through a ring in shared memory.

A CPU pipeline hands every micro-batch's activations to the next stage and the sampled
tokens back to the driver. Through gloo, each such message between two busy processes
waits for a send/recv handshake that needs each side's progress thread to get a core
(milliseconds on a loaded CPU: docs/benchmarks/2026-11-30-cpu-2core.md). Through a shared ring it arrives as soon as
the receiver looks.

Layout of the segment: the producer's count of messages posted (one cache line), the
consumer's count of messages taken (the next line), then `num_slots` slots, each an int64
length and `slot_bytes` bytes. Message n lives in slot n % num_slots. The producer writes
the slot, then raises `posted`; the consumer reads it, then raises `taken`, which frees the
slot. One producer and one consumer per ring; stores are ordered on x86-64 (TSO), so a
side that sees a count also sees the bytes written before it (`shm_allreduce.supported`
decides where rings are used). The creating process unlinks the file once both sides
have mapped it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from meshserve.parallel.comm.shm_names import shm_path
from meshserve.parallel.comm.spin_wait import spin_until

_LINE = 64
_HEADER = 2 * _LINE
_LENGTH = 8



class RingTimeout(RuntimeError):
    """The other side did not post (or take) a message within the timeout."""


class ShmRing:
    """A ring of `num_slots` messages of up to `slot_bytes` each; `create` on one side,
    `attach` (by path) on the other, then `unlink` once both have it mapped."""

    def __init__(self, path: str, *, create: bool, num_slots: int, slot_bytes: int,
                 timeout_s: float | None = None, what: str = "shared-memory ring") -> None:
        assert num_slots >= 1 and slot_bytes >= 1, (num_slots, slot_bytes)
        self.path, self.num_slots, self.slot_bytes = path, num_slots, slot_bytes
        self.timeout_s, self.what = timeout_s, what
        self._stride = _LENGTH + slot_bytes
        total = _HEADER + num_slots * self._stride
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # Reserve the pages now: on a full tmpfs, ftruncate alone would succeed and
                # the first write into the hole would kill the process with SIGBUS.
                os.posix_fallocate(fd, 0, total)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
        # A plain file mapping: no multiprocessing resource tracker to unlink or warn about it.
        self._buf = mmap.mmap(fd, total)
        os.close(fd)
        self._posted = np.ndarray((1,), dtype=np.int64, buffer=self._buf, offset=0)
        self._taken = np.ndarray((1,), dtype=np.int64, buffer=self._buf, offset=_LINE)
        self._lengths = [np.ndarray((1,), dtype=np.int64, buffer=self._buf,
                                    offset=_HEADER + i * self._stride) for i in range(num_slots)]
        self._bytes = torch.frombuffer(self._buf, dtype=torch.uint8,
                                       count=total - _HEADER, offset=_HEADER)
        self.num_messages = 0
        """Messages this side has posted (producer) or taken (consumer)."""

    @classmethod
    def new_path(cls) -> str:
        """A fresh file name under SHM_DIR."""
        return shm_path("p2p")

    def unlink(self) -> None:
        """Remove the file name (both sides keep their mappings)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _slot(self, n: int, nbytes: int) -> torch.Tensor:
        start = (n % self.num_slots) * self._stride + _LENGTH
        return self._bytes[start:start + nbytes]

    # producer
    def put(self, parts: Sequence[torch.Tensor], *, length: int | None = None,
            alive: Callable[[], None] = lambda: None) -> None:
        """Post one message: the contiguous CPU tensors `parts`, back to back; waits while
        every slot holds a message not yet taken. `length` overrides the length field the
        consumer reads (a marker for a message that goes another way)."""
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        assert nbytes <= self.slot_bytes, (nbytes, self.slot_bytes)
        n = self._claim(alive)
        slot, offset = self._slot(n, nbytes), 0
        for p in parts:
            size = p.numel() * p.element_size()
            slot[offset:offset + size].view(p.dtype).view(p.shape).copy_(p)
            offset += size
        self._publish(n, nbytes if length is None else length)

    def put_bytes(self, data: bytes, alive: Callable[[], None] = lambda: None) -> None:
        """Post `data` (at most `slot_bytes`)."""
        self.put([torch.frombuffer(bytearray(data), dtype=torch.uint8)] if data else [],
                 length=len(data), alive=alive)

    def put_message(self, data: bytes, alive: Callable[[], None] = lambda: None) -> None:
        """Post `data` of any length: over as many slots as it needs, each slot's length
        field the bytes left from that slot on (`take_message` joins them). Waits for the
        consumer whenever every slot is full."""
        view = memoryview(data)
        offset = 0
        while True:
            n = self._claim(alive)
            part = view[offset:offset + self.slot_bytes]
            start = _HEADER + (n % self.num_slots) * self._stride + _LENGTH
            self._buf[start:start + len(part)] = part
            self._publish(n, len(data) - offset)
            offset += len(part)
            if offset >= len(data):
                return

    def _claim(self, alive: Callable[[], None]) -> int:
        """(Producer) Wait for a free slot; the number of the message it will hold."""
        n = self.num_messages
        self._wait(lambda: n - int(self._taken[0]) < self.num_slots, "take", n, alive)
        return n

    def _publish(self, n: int, length: int) -> None:
        """(Producer) Message n's slot is written: set its length field, then post it."""
        self._lengths[n % self.num_slots][0] = length
        self._posted[0] = n + 1
        self.num_messages = n + 1

    def drain(self, alive: Callable[[], None] = lambda: None) -> None:
        """Wait until the consumer has taken every message posted."""
        n = self.num_messages
        self._wait(lambda: int(self._taken[0]) >= n, "take", n - 1, alive)

    # consumer
    def wait_message(self, alive: Callable[[], None] = lambda: None) -> int:
        """Wait for the next message; its length field."""
        n = self.num_messages
        self._wait(lambda: int(self._posted[0]) > n, "post", n, alive)
        return int(self._lengths[n % self.num_slots][0])

    def take_into(self, out: torch.Tensor, alive: Callable[[], None] = lambda: None) -> None:
        """Copy the next message (exactly `out`'s bytes) into the contiguous tensor `out`."""
        nbytes = out.numel() * out.element_size()
        length = self.wait_message(alive)
        if length != nbytes:
            raise RuntimeError(f"{self.what}: message #{self.num_messages} has {length} bytes, "
                               f"the receiver expected {nbytes}")
        out.view(-1).view(torch.uint8).copy_(self._slot(self.num_messages, nbytes))
        self._release()

    def take_bytes(self, alive: Callable[[], None] = lambda: None) -> tuple[int, bytes]:
        """The next message's length field and its bytes (none when the field is negative:
        a marker put with `length`)."""
        length = self.wait_message(alive)
        data = (self._slot(self.num_messages, length).numpy().tobytes()
                if length > 0 else b"")
        self._release()
        return length, data

    def take_message(self, alive: Callable[[], None] = lambda: None, *,
                     idle: bool = False) -> bytes:
        """The next message `put_message` posted, whole. `idle`: wait for its first slot
        without limit (a rank between steps); the ring's timeout bounds every other wait."""
        n = self.num_messages
        if idle:
            spin_until(lambda: int(self._posted[0]) > n, None, alive)
        parts: list[bytes] = []
        left = None
        while left is None or left > 0:
            length = self.wait_message(alive)
            if left is not None and length != left:
                raise RuntimeError(f"{self.what}: message #{self.num_messages} continues "
                                   f"with {length} bytes left, {left} expected")
            size = min(length, self.slot_bytes)
            parts.append(self._slot(self.num_messages, size).numpy().tobytes())
            self._release()
            left = length - size
        return b"".join(parts)

    def _release(self) -> None:
        self.num_messages += 1
        self._taken[0] = self.num_messages

    def _wait(self, ready: Callable[[], bool], action: str, n: int,
              alive: Callable[[], None]) -> None:
        if not spin_until(ready, self.timeout_s, alive):
            raise RingTimeout(f"{self.what}: the other side did not {action} message "
                              f"#{n} within {self.timeout_s:g} s (dead or hung)")

    def close(self) -> None:
        """Drop this process's mapping."""
        del self._posted, self._taken, self._lengths, self._bytes
        self._buf.close()


RingKey = tuple[str, int, int]
"""(purpose, producer's global rank, consumer's global rank)."""


def connect_rings(wanted: Sequence[tuple[RingKey, int, int]], rank: int, *,
                  timeout_s: float | None) -> dict[RingKey, ShmRing]:
    """The rings among `wanted` ((key, num_slots, slot_bytes), the same list on every rank)
    that this rank produces or consumes. Collective over the default process group: every
    rank calls it. A ring /dev/shm has no room for is left out (its messages go by gloo)."""
    import torch.distributed as dist

    mine: dict[RingKey, ShmRing] = {}
    made: dict[RingKey, str] = {}
    for key, num_slots, slot_bytes in wanted:
        if key[1] == rank:
            path = ShmRing.new_path()
            try:
                mine[key] = ShmRing(path, create=True, num_slots=num_slots,
                                    slot_bytes=slot_bytes, timeout_s=timeout_s, what=_what(key))
                made[key] = path
            except OSError:
                pass
    every: list[dict[RingKey, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, made)
    for key, num_slots, slot_bytes in wanted:
        path = (every[key[1]] or {}).get(key)
        if key[2] == rank and path is not None:
            mine[key] = ShmRing(path, create=False, num_slots=num_slots, slot_bytes=slot_bytes,
                                timeout_s=timeout_s, what=_what(key))
    dist.barrier()  # every consumer has mapped its rings
    for key in made:
        mine[key].unlink()
    return mine


def _what(key: RingKey) -> str:
    return f"shared-memory {key[0]} ring from rank {key[1]} to rank {key[2]}"
