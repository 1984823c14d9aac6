"""Point-to-point traffic of a pipeline: activations to the next stage, results to the driver.

Sends never block the sender (isend, buffers kept until done), so a stage hands its
micro-batch on and starts the next one; at most `max_pending` sends stay outstanding.
Every wait is bounded by `timeout` (None: by the process group's own).

Between CPU ranks on one host a shared-memory ring (parallel/comm/shm_ring.py) carries the
messages that fit its slots instead of gloo: both sides tell from the message's size (the
receiver knows it from the step's metadata, or from the ring's length field) which way it
comes, so the two ways keep one order.
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from meshserve.parallel.comm.shm_ring import ShmRing


def wait(work: dist.Work | None, timeout: timedelta | None) -> None:
    """Wait for `work`, at most `timeout` when given."""
    assert work is not None
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def recv(buf: torch.Tensor, src: int, group: dist.ProcessGroup | None,
         timeout: timedelta | None) -> torch.Tensor:
    """Receive into `buf` from global rank `src`, waiting at most `timeout`."""
    wait(dist.irecv(buf, src=src, group=group), timeout)
    return buf


class PendingSends:
    """isend works, each with the buffers it reads, kept alive until complete."""

    def __init__(self, max_pending: int, timeout: timedelta | None) -> None:
        assert max_pending >= 1, max_pending
        self.max_pending, self.timeout = max_pending, timeout
        self._works: deque[tuple[dist.Work | None, tuple[torch.Tensor, ...]]] = deque()

    def add(self, work: dist.Work | None, *buffers: torch.Tensor) -> None:
        """Track a send; waits for the oldest ones beyond `max_pending`."""
        self._works.append((work, buffers))
        while len(self._works) > self.max_pending:
            wait(self._works.popleft()[0], self.timeout)

    def drain(self) -> None:
        """Wait for every outstanding send."""
        while self._works:
            wait(self._works.popleft()[0], self.timeout)


class TensorChannel:
    """Tensors whose shape both sides know (from the step's metadata), one way between this
    rank and `peer`: through a shared-memory `ring` when there is one and the message fits
    a slot, else by isend/irecv on `group`. A message is one or more tensors of one dtype,
    back to back; the receiver gets them as one tensor of the shape it asks for."""

    def __init__(self, group: dist.ProcessGroup | None, peer: int, max_pending: int,
                 timeout: timedelta | None, ring: ShmRing | None = None,
                 alive: Callable[[], None] = lambda: None) -> None:
        self.group, self.peer, self.timeout = group, peer, timeout
        self.ring, self.alive = ring, alive
        self._pending = PendingSends(max_pending, timeout)
        self.num_bytes_sent = 0

    def send(self, parts: Sequence[torch.Tensor]) -> None:
        """Send `parts` (same dtype and device) as one message, without waiting for it to
        be received (a full ring waits for a free slot)."""
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        self.num_bytes_sent += nbytes
        if _fits(self.ring, nbytes, parts[0]):
            assert self.ring is not None
            self.ring.put([p.contiguous() for p in parts], alive=self.alive)
            return
        buf = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0]
        buf = buf.contiguous()
        self._pending.add(dist.isend(buf, dst=self.peer, group=self.group), buf)

    def recv(self, shape: Sequence[int], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """The next message, as a new tensor of `shape`."""
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        if _fits(self.ring, buf.numel() * buf.element_size(), buf):
            assert self.ring is not None
            self.ring.take_into(buf, alive=self.alive)
        else:
            recv(buf, self.peer, self.group, self.timeout)
        return buf

    def drain(self) -> None:
        """Wait until the peer has taken every message sent."""
        self._pending.drain()
        if self.ring is not None:
            self.ring.drain(alive=self.alive)


def _fits(ring: ShmRing | None, nbytes: int, like: torch.Tensor) -> bool:
    """Whether a message of `nbytes` (tensors like `like`) goes through `ring`."""
    return ring is not None and like.device.type == "cpu" and nbytes <= ring.slot_bytes


class StageLink:
    """Hidden states and residuals between neighbouring stages at the same TP rank.

    Both travel as one [2, T, hidden] message (one instead of two); the receiver knows T
    from the step's metadata, so no shape goes over the wire.
    """

    def __init__(self, group: dist.ProcessGroup | None, prev_rank: int | None,
                 next_rank: int | None, max_pending: int, timeout: timedelta | None, *,
                 ring_in: ShmRing | None = None, ring_out: ShmRing | None = None,
                 watch: Callable[[int], Callable[[], None]] = lambda rank: lambda: None
                 ) -> None:
        """`watch(rank)`: a check, called while waiting on that neighbour through shared
        memory, that raises once it is gone (ProcessGroups.watch)."""
        assert group is not None or (prev_rank is None and next_rank is None)
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self._in = (TensorChannel(group, prev_rank, max_pending, timeout, ring_in,
                                  alive=watch(prev_rank))
                    if prev_rank is not None else None)
        self._out = (TensorChannel(group, next_rank, max_pending, timeout, ring_out,
                                   alive=watch(next_rank))
                     if next_rank is not None else None)

    @property
    def num_bytes_sent(self) -> int:
        """Activation bytes handed to the next stage so far."""
        return self._out.num_bytes_sent if self._out is not None else 0

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand (hidden, residual) [T, hidden] each to the next stage."""
        assert self._out is not None
        self._out.send([hidden, residual])

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden, residual) for a micro-batch of `num_tokens`."""
        assert self._in is not None
        buf = self._in.recv((2, num_tokens, hidden_size), dtype, device)
        return buf[0], buf[1]

    def drain(self) -> None:
        """Wait until the next stage has taken every activation sent."""
        if self._out is not None:
            self._out.drain()


class ObjectChannel:
    """Pickled objects between two ranks of a CPU (gloo) group: a length, then the bytes.

    With a `ring` (this side's end of a shared-memory ring to or from the peer), an object
    that fits a slot goes through it whole; a bigger one sends a marker through the ring
    (its length, negated) and the bytes through gloo. `alive` is called while waiting on
    the ring and raises to give up (the driver: a rank it spawned has died)."""

    def __init__(self, group: dist.ProcessGroup, max_pending: int,
                 timeout: timedelta | None, *, ring: ShmRing | None = None,
                 alive: Callable[[], None] = lambda: None) -> None:
        self.group, self.timeout, self.ring, self.alive = group, timeout, ring, alive
        self._pending = PendingSends(2 * max_pending, timeout)  # two sends per object

    def send(self, obj: object, dst: int) -> None:
        """Send `obj` to global rank `dst` without waiting for it to be received."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if self.ring is not None:
            if len(data) <= self.ring.slot_bytes:
                self.ring.put_bytes(data, alive=self.alive)
                return
            self.ring.put([], length=-len(data), alive=self.alive)
        else:
            header = torch.tensor([len(data)], dtype=torch.int64)
            self._pending.add(dist.isend(header, dst=dst, group=self.group), header)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._pending.add(dist.isend(payload, dst=dst, group=self.group), payload)

    def recv(self, src: int) -> object:
        """The next object from global rank `src`."""
        if self.ring is not None:
            length, data = self.ring.take_bytes(alive=self.alive)
            if length > 0:
                return pickle.loads(data)
            size = -length
        else:
            header = recv(torch.empty(1, dtype=torch.int64), src, self.group, self.timeout)
            size = int(header.item())
        payload = recv(torch.empty(size, dtype=torch.uint8), src, self.group, self.timeout)
        return pickle.loads(payload.numpy().tobytes())

    def drain(self) -> None:
        """Wait until every object sent has been received."""
        self._pending.drain()
        if self.ring is not None:
            self.ring.drain(alive=self.alive)
