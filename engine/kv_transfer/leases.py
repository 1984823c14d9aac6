"""KV leases: the blocks a prefill replica holds for a transfer, until a decode replica has
read them, the request is aborted, or the lease lapses.

Fail closed: a block is handed back (to be freed) exactly once, and never while a read
of it is in flight. A lease that lapses with nobody reading is expired and counted; a
read after that fails with `LeaseExpired` (the request must fail or be re-prefilled,
never be served from freed KV). An abort during a read defers the freeing to the read's
end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.validation import require

_REMEMBERED = 4096
"""Expired request ids kept to tell "expired" from "unknown" in the error."""


def _expect(ok: bool, message: str) -> None:
    """A caller's bookkeeping error: the lease protocol was not followed."""
    if not ok:
        raise RuntimeError(message)


class LeaseExpired(RuntimeError):
    """The blocks of a request were read after its lease lapsed (or were never held)."""


@dataclass
class _Lease:
    blocks: tuple[int, ...]
    deadline: float
    reading: bool = False
    aborted: bool = False


class KVLeases:
    """Prefill-side leases on KV blocks, keyed by request id; times are the caller's clock."""

    def __init__(self, lease_s: float) -> None:
        require(lease_s > 0, "disagg.kv_lease_s", lease_s, "a positive number of seconds")
        self.lease_s = lease_s
        self._leases: dict[str, _Lease] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self.num_expired = 0
        """Leases that lapsed with nobody reading them."""

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def request_ids(self) -> list[str]:
        """The requests holding a lease, oldest first."""
        return list(self._leases)

    def hold(self, request_id: str, blocks: Sequence[int], now: float) -> None:
        """Hold a finished prefill's blocks for a reader until `now + lease_s`."""
        _expect(request_id not in self._leases, f"request {request_id!r} already holds a KV lease")
        self._leases[request_id] = _Lease(tuple(blocks), now + self.lease_s)

    def reading(self, request_id: str) -> bool:
        """Whether a read of the request's blocks is in flight."""
        lease = self._leases.get(request_id)
        return lease is not None and lease.reading

    def begin_read(self, request_id: str, now: float) -> tuple[int, ...]:
        """The blocks to read; they stay held until `end_read`, whatever the clock says."""
        lease = self._leases.get(request_id)
        if lease is None or lease.aborted:
            why = ("its lease expired after disagg.kv_lease_s="
                   f"{self.lease_s} s" if request_id in self._expired else "it holds no lease")
            raise LeaseExpired(f"KV of request {request_id!r} cannot be read: {why}")
        _expect(not lease.reading, f"request {request_id!r}: its KV is already being read")
        if now > lease.deadline:
            raise LeaseExpired(f"KV of request {request_id!r} cannot be read: its lease "
                               f"expired after disagg.kv_lease_s={self.lease_s} s")
        lease.reading = True
        return lease.blocks

    def end_read(self, request_id: str) -> tuple[int, ...]:
        """A read ended (done or failed): the blocks to free now."""
        lease = self._leases.get(request_id)
        if lease is None or not lease.reading:
            raise RuntimeError(f"request {request_id!r}: no read of its KV is in flight")
        del self._leases[request_id]
        return lease.blocks

    def abort(self, request_id: str) -> tuple[int, ...]:
        """The request is gone: its blocks to free now, or () while a read is in flight
        (then `end_read` frees them)."""
        lease = self._leases.get(request_id)
        if lease is None:
            return ()
        if lease.reading:
            lease.aborted = True
            return ()
        del self._leases[request_id]
        return lease.blocks

    def expire(self, now: float) -> list[tuple[str, tuple[int, ...]]]:
        """Leases past their deadline that nobody is reading: (request id, blocks to free)."""
        lapsed = [rid for rid, lease in self._leases.items()
                  if now > lease.deadline and not lease.reading]
        out = []
        for rid in lapsed:
            out.append((rid, self._leases.pop(rid).blocks))
            self._expired[rid] = None
            if len(self._expired) > _REMEMBERED:
                self._expired.popitem(last=False)
        self.num_expired += len(out)
        return out
