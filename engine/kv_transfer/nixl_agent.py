"""KV blocks read from another process's paged cache over NIXL (UCX underneath: shared
memory or TCP between hosts' memory on CPUs, NVLink or InfiniBand between GPUs).

Each side registers its whole cache once and publishes its agent's metadata and its
cache's layout (per layer the K and V base addresses, the bytes of one block) under its
name in a store both can reach (the world's torch.distributed store). The decode side
has allocated its blocks first; it then READs the prefill side's blocks straight into
them, one descriptor per block per layer per K/V; NIXL tags the READ with the transfer
id and notifies the prefill side when it lands (the prefill side's lease ends by the
front's word, not by these: they are counted and dropped, so none pile up).

A READ past disagg.transfer_timeout_s is cancelled through NIXL (releasing its handle)
before the read fails; where NIXL cannot cancel it, the read waits for the transfer's own
end for as long again, and failing that raises ReadStillActive: the caller then keeps
the destination blocks out of use, since the READ may still write into them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from meshserve.engine.kv_transfer.connector import ReadStillActive

Cache = Sequence[tuple[torch.Tensor, torch.Tensor]]

POLL_S = 0.0002
"""How often a read polls its transfer's state."""


class XferAgent(Protocol):
    """The calls of a nixl_agent a read's end makes."""

    def check_xfer_state(self, handle: Any) -> str: ...
    def release_xfer_handle(self, handle: Any) -> None: ...


def await_transfer(agent: XferAgent, handle: Any, state: str, timeout_s: float,
                   lock: threading.Lock, what: str,
                   clock: Callable[[], float] = time.monotonic) -> None:
    """Wait for a posted transfer to end, then release its handle. Past `timeout_s` it is
    cancelled through NIXL (a release cancels an active transfer, or refuses and raises);
    one NIXL would not cancel is waited for up to `timeout_s` more. Raises RuntimeError
    naming `what` on a failure, ReadStillActive where the transfer may still be writing.
    Every agent call holds `lock`."""
    deadline = clock() + timeout_s
    while state == "PROC" and clock() <= deadline:
        time.sleep(POLL_S)
        with lock:
            state = agent.check_xfer_state(handle)
    if state != "PROC":
        with lock:
            agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"{what} failed ({state})")
        return
    try:
        with lock:
            agent.release_xfer_handle(handle)  # cancels it
    except Exception:  # noqa: BLE001 - NIXL could not cancel it: wait for its own end
        grace = clock() + timeout_s
        while state == "PROC" and clock() <= grace:
            time.sleep(POLL_S)
            with lock:
                state = agent.check_xfer_state(handle)
        if state == "PROC":
            raise ReadStillActive(f"{what} took over {timeout_s} s and could not be "
                                  f"cancelled; still active {timeout_s} s later, its "
                                  "destination blocks are kept out of use") from None
        with lock:
            agent.release_xfer_handle(handle)
    raise RuntimeError(f"{what} took over {timeout_s} s (cancelled)")


def _quiet_and_safe() -> None:
    """Before nixl is first imported: its INFO lines would go to stdout, and on a host
    without InfiniBand UCX's InfiniBand modules pull in the system's libnl beside the copy
    bundled with the wheel, and the two crash the process at exit. Explicit settings of
    NIXL_LOG_LEVEL and UCX_MODULES are left as they are."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    ib = "/sys/class/infiniband"
    if not (os.path.isdir(ib) and os.listdir(ib)):
        os.environ.setdefault("UCX_MODULES", "^ib")


def nixl_available() -> bool:
    """Whether the `nixl` package imports here."""
    _quiet_and_safe()
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class CacheLayout:
    """Where a cache's blocks are: base addresses of each layer's K then V, and the bytes
    of one block, of one token's row of it (every head) and of one head in a row."""

    bases: tuple[int, ...]
    block_bytes: int
    num_blocks: int
    device_id: int
    mem_type: str
    row_bytes: int = 0
    head_bytes: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.bases) // 2

    @property
    def num_heads(self) -> int:
        return self.row_bytes // self.head_bytes

    @classmethod
    def of(cls, cache: Cache) -> CacheLayout:
        k = cache[0][0]
        for t in (t for kv in cache for t in kv):
            if not t.is_contiguous() or t.shape != k.shape or t.dtype != k.dtype:
                raise ValueError("a NIXL-registered KV cache needs contiguous layers of one "
                                 "shape and dtype")
        block_bytes = k[0].numel() * k.element_size()
        dev = (k.device.index or 0) if k.device.type == "cuda" else 0
        return cls(tuple(t.data_ptr() for kv in cache for t in kv), block_bytes, k.shape[0],
                   dev, "VRAM" if k.device.type == "cuda" else "DRAM",
                   k[0, 0].numel() * k.element_size(), k.shape[3] * k.element_size())

    def descs(self, blocks: Sequence[int], layers: slice = slice(None),
              heads: slice | None = None) -> list[tuple[int, int, int]]:
        """(address, bytes, device) of `blocks` in each of `layers`' K and V, in that order:
        whole blocks, or with `heads` each token's row of those heads."""
        bases = [b for i in range(self.num_layers)[layers]
                 for b in self.bases[2 * i:2 * i + 2]]
        if heads is None:
            return [(base + b * self.block_bytes, self.block_bytes, self.device_id)
                    for base in bases for b in blocks]
        rows = self.block_bytes // self.row_bytes
        at, size = heads.start * self.head_bytes, (heads.stop - heads.start) * self.head_bytes
        return [(base + b * self.block_bytes + t * self.row_bytes + at, size, self.device_id)
                for base in bases for b in blocks for t in range(rows)]


PUMP_S = 0.001
"""How often this side's agent is progressed while it serves reads (NIXL's own progress
thread spins a whole core, which a replica sharing the host's cores cannot spare)."""


class NixlKV:
    """This process's NIXL agent over its KV cache; peers are found by name in `store`.

    NIXL's progress thread is off (it busy-polls a core); a thread of ours progresses the
    agent every PUMP_S instead (a peer's READ over TCP needs this side to progress) and
    collects the notifications. Every agent call holds one lock."""

    def __init__(self, name: str, cache: Cache, store: dist.Store,
                 timeout_s: float = 60.0, store_lock: threading.Lock | None = None) -> None:
        """`store_lock`: taken around every call on `store` (a connection other threads
        use too)."""
        _quiet_and_safe()
        from nixl._api import nixl_agent, nixl_agent_config

        self.name, self.store, self.timeout_s = name, store, timeout_s
        self._store_lock = store_lock or threading.Lock()
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False,
                                                        backends=["UCX"]))
        self.layout = CacheLayout.of(cache)
        self._reg = self.agent.register_memory([t for kv in cache for t in kv])
        self._peers: dict[str, CacheLayout] = {}
        self._lock = threading.Lock()
        self.num_notifs = 0
        """Notifications received (peers' READs of this cache that landed), counted only."""
        self._stopped = threading.Event()
        self.bytes_read = 0
        with self._store_lock:
            store.set(f"nixl/{name}/meta", self.agent.get_agent_metadata())
            store.set(f"nixl/{name}/layout", json.dumps(self.layout.__dict__))
        self._pump_thread = threading.Thread(target=self._pump, name=f"meshserve-nixl-{name}",
                                             daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        while not self._stopped.wait(PUMP_S):
            with self._lock:
                if self._stopped.is_set():
                    return
                notifs = self.agent.get_new_notifs()  # (this progresses the agent too)
            self.num_notifs += sum(len(msgs) for msgs in notifs.values())

    def _peer(self, name: str) -> CacheLayout:
        if name not in self._peers:
            with self._store_lock:
                self.store.wait([f"nixl/{name}/meta", f"nixl/{name}/layout"])
                meta = self.store.get(f"nixl/{name}/meta")
                fields = json.loads(self.store.get(f"nixl/{name}/layout"))
            with self._lock:
                self.agent.add_remote_agent(meta)
            layout = CacheLayout(**{**fields, "bases": tuple(fields["bases"])})
            if (layout.head_bytes, layout.block_bytes // layout.row_bytes) != (
                    self.layout.head_bytes, self.layout.block_bytes // self.layout.row_bytes):
                raise ValueError(
                    f"NIXL peer {name!r} has KV heads of {layout.head_bytes} bytes in blocks "
                    f"of {layout.block_bytes // layout.row_bytes} tokens, this side "
                    f"{self.layout.head_bytes} in {self.layout.block_bytes // self.layout.row_bytes}"
                    ": allowed is the same on both sides")
            self._peers[name] = layout
        return self._peers[name]

    def read(self, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int],
             transfer_id: int, *, remote_part: tuple[slice, slice] | None = None,
             local_part: tuple[slice, slice] | None = None) -> None:
        """Copy `peer`'s blocks into this cache's `local_blocks` (already allocated here);
        the peer is notified with the transfer id once they have landed. A part, (layers,
        heads) of each side's own cache, reads only those (the same count on both sides);
        by default every layer and head. Bounded by `timeout_s` (see `await_transfer`);
        raises RuntimeError naming the peer on failure, ReadStillActive where the READ
        may still write into `local_blocks`."""
        if len(remote_blocks) != len(local_blocks):
            raise ValueError(f"{len(remote_blocks)} remote blocks for {len(local_blocks)} "
                             "local ones")
        tag = f"kv:{transfer_id};".encode()
        if not remote_blocks:
            self._peer(peer)
            with self._lock:
                self.agent.send_notif(peer, tag)
            return
        layout = self._peer(peer)
        r_layers, r_heads = remote_part or (slice(None), slice(0, layout.num_heads))
        l_layers, l_heads = local_part or (slice(None), slice(0, self.layout.num_heads))
        whole = (r_heads.stop - r_heads.start == layout.num_heads
                 and l_heads.stop - l_heads.start == self.layout.num_heads)
        local_descs = self.layout.descs(local_blocks, l_layers, None if whole else l_heads)
        remote_descs = layout.descs(remote_blocks, r_layers, None if whole else r_heads)
        if len(local_descs) != len(remote_descs):
            raise ValueError(f"a NIXL read of {len(remote_descs)} remote pieces into "
                             f"{len(local_descs)} local ones")
        with self._lock:
            local = self.agent.get_xfer_descs(local_descs, self.layout.mem_type)
            remote = self.agent.get_xfer_descs(remote_descs, layout.mem_type)
            handle = self.agent.initialize_xfer("READ", local, remote, peer, tag)
            state = self.agent.transfer(handle)
        await_transfer(self.agent, handle, state, self.timeout_s, self._lock,
                       f"NIXL read of {len(remote_blocks)} KV blocks from {peer!r}")
        self.bytes_read += sum(size for _, size, _ in local_descs)

    def close(self) -> None:
        self._stopped.set()
        self._pump_thread.join(timeout=5)
        with self._lock:
            self.agent.deregister_memory(self._reg)
