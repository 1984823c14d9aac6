"""Ordered point-to-point between pairs of ranks: a process group per directed pair.

NCCL's send and receive carry no tags: the n-th send from one rank to another meets the
n-th receive posted for it, so both sides must issue their messages to each other in the
same order, and one message skipped or abandoned shifts every later one onto the wrong
buffer. A KV world over NCCL therefore keeps one group per (source rank, destination
rank), made on first use by both sides (rank 0 of it the source, rank 1 the destination),
over which each side issues its messages in an agreed order (the caller's part: the
torch connector numbers the asks).

A pair whose transfer failed or timed out is never used again: its group is retired (an
NCCL one aborted, which also ends a receive stuck on a lost peer), and the pair starts a
new group under the next generation. Each side learns the other's generation from the
messages' envelope (the torch connector's ask carries it): the source adopts a newer one
when it sees it and drops asks of an older one, whose asker then times out and moves on
itself; so after one failure both sides meet again on a fresh group, with nothing left
in flight that could land on the wrong buffer.

The same groups over gloo (host memory; tags unused) run the ordering anywhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")

POLL_S = 0.0002
"""How often an NCCL wait checks its work (it never blocks on it: a receive from a lost
peer would block the stream that waits)."""

MARGIN_S = 60.0
"""An NCCL group's own timeout beyond a transfer's: its watchdog fires only if retiring
it did not end a stuck message."""


def nccl_usable() -> bool:
    """Whether NCCL groups can be made in this process."""
    return dist.is_nccl_available() and torch.cuda.is_available()


class PairGroups:
    """This rank's groups with every peer it moves messages to or from."""

    def __init__(self, open_store: Callable[[], dist.Store], rank: int, backend: str,
                 timeout_s: float) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"pair groups: backend {backend!r}; allowed: {BACKENDS}")
        if backend == "nccl" and not nccl_usable():
            raise ValueError("pair groups over nccl: this torch has no NCCL or sees no GPU")
        self.open_store, self.rank, self.backend = open_store, rank, backend
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._gen: dict[tuple[int, int], int] = {}
        self._groups: dict[tuple[int, int, int], dist.ProcessGroup] = {}
        self._issuing: dict[tuple[int, int], threading.Lock] = {}
        self._retired: list[dist.ProcessGroup] = []
        """Retired groups, kept until `close` (NCCL's aborted): a gloo group dropped while
        a message of it is still pending would wait for it to time out first."""
        self.retirements = 0
        self._closed = False

    def generation(self, src: int, dst: int) -> int:
        """The generation pair (src, dst) is on, as this rank knows it."""
        with self._lock:
            return self._gen.get((src, dst), 0)

    @contextmanager
    def issuing(self, src: int, dst: int, deadline: float) -> Iterator[None]:
        """Held while one transfer's messages on pair (src, dst) are issued: another's
        then come wholly before or after them. RuntimeError if another holds it past
        `deadline`."""
        with self._lock:
            lock = self._issuing.setdefault((src, dst), threading.Lock())
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"ranks {src}->{dst}: another transfer was still being "
                               "issued at the deadline")
        try:
            yield
        finally:
            lock.release()

    def adopt(self, src: int, dst: int, gen: int) -> bool:
        """The peer is on generation `gen`: move there if it is newer (retiring the older
        groups); False if `gen` is older than this rank's (the message is to be dropped)."""
        with self._lock:
            have = self._gen.get((src, dst), 0)
            if gen < have:
                return False
            if gen > have:
                self._gen[(src, dst)] = gen
                old = self._retire_below(src, dst, gen)
        if gen > have:
            self._end(old)
        return True

    def retire(self, src: int, dst: int, gen: int) -> None:
        """A transfer on generation `gen` of pair (src, dst) failed: that group is never
        used again, and the pair's next message goes on `gen + 1` (once per generation,
        however many of its transfers fail)."""
        with self._lock:
            if self._gen.get((src, dst), 0) == gen:
                self._gen[(src, dst)] = gen + 1
                self.retirements += 1
            old = self._retire_below(src, dst, gen + 1)
        self._end(old)

    def _retire_below(self, src: int, dst: int, gen: int) -> list[dist.ProcessGroup]:
        """Under the lock: pair (src, dst)'s groups older than `gen`, no longer handed out
        (kept, so none is destroyed while a message of it may be pending)."""
        old = [self._groups.pop(k) for k in list(self._groups)
               if k[:2] == (src, dst) and k[2] < gen]
        self._retired.extend(old)
        return old

    def _end(self, groups: list[dist.ProcessGroup]) -> None:
        """NCCL: abort retired groups, which ends what is stuck on them (outside the lock:
        an abort may wait on the GPU); gloo's end as their messages time out."""
        if self.backend != "nccl":
            return
        for group in groups:
            for name in ("abort", "_abort", "_shutdown"):  # (named so as torch grew)
                end = getattr(group, name, None)
                if end is not None:
                    try:
                        end()
                    except RuntimeError:
                        pass
                    break

    def group(self, src: int, dst: int, gen: int) -> dist.ProcessGroup:
        """Generation `gen`'s group of pair (src, dst), made on first use (a gloo group
        waits for the peer to make it too, up to a transfer's timeout)."""
        key = (src, dst, gen)
        with self._lock:
            if self._closed:
                raise RuntimeError("the KV connector is closed")
            if key in self._groups:
                return self._groups[key]
            if self._gen.get((src, dst), 0) > gen:
                raise RuntimeError(f"the group of ranks {src}->{dst} was retired")
        # Its own connection, whose waits (the peer joining; NCCL's id) are bounded by a
        # transfer's timeout; NCCL then sets its communicator up with the first message.
        conn = self.open_store()
        conn.set_timeout(timedelta(seconds=self.timeout_s))
        store = dist.PrefixStore(f"meshserve-kv-pair/{src}-{dst}/{gen}", conn)
        me = 0 if self.rank == src else 1
        made: dist.ProcessGroup
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=self.timeout_s + MARGIN_S)
            made = cast(dist.ProcessGroup, dist.ProcessGroupNCCL(store, me, 2, options))
        else:
            made = cast(dist.ProcessGroup,
                        dist.ProcessGroupGloo(store, me, 2, timedelta(seconds=self.timeout_s)))
        with self._lock:
            if self._gen.get((src, dst), 0) <= gen and not self._closed:
                return self._groups.setdefault(key, made)
            self._retired.append(made)  # (retired while it was made)
        self._end([made])
        raise RuntimeError(f"the group of ranks {src}->{dst} was retired")

    def wait(self, work: dist.Work, deadline: float) -> None:
        """Wait for one message until `deadline`; RuntimeError if it fails or is late."""
        left = deadline - time.monotonic()
        if self.backend == "gloo":
            if not work.wait(timedelta(seconds=max(0.001, left))):
                raise RuntimeError("the message did not complete in time")
            return
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError("the message did not complete in time")
            time.sleep(POLL_S)
        work.wait()  # (raises its error; the stream waits on what has ended)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            groups = list(self._groups.values())
            self._groups.clear()
            self._retired.clear()
        self._end(groups)
