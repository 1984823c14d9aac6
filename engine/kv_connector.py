"""How KV blocks move between replicas: one interface, two backends.

The decode side has allocated the blocks the KV lands in before any byte moves, and the
prefill side holds the blocks it reads from under a lease (engine/kv_transfer.py), so a
transfer never touches a block anything else may use. Both calls run off the replica's
main thread (one thread per transfer) and are bounded by disagg.transfer_timeout_s.

- `nixl`: the decode side READs the prefill side's registered cache straight into its
  own blocks over UCX (shared memory or TCP between processes' host memory; NVLink or
  InfiniBand between GPUs); the prefill side's thread does nothing.
- `torch`: torch.distributed point-to-point over a gloo group of every replica's driver:
  the prefill side sends the packed blocks, the decode side receives them (a GPU cache is
  staged through host memory).

Replicas find each other (addresses, NIXL metadata, the KV spec the handshake compares)
through one TCP store the front hosts.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from meshserve.engine.kv_handshake import KVSpec, check_handshake
from meshserve.engine.worker.kv_blocks import KVCache, gather_blocks, scatter_blocks
from meshserve.parallel.comm.nixl_kv import NixlKV, nixl_available

KV_STARTUP_S = 300.0
"""Longest a replica waits at start-up for the others' handshake and group (they load
their models meanwhile); one transfer has disagg.transfer_timeout_s."""


class KVConnector(ABC):
    """One replica's end of KV traffic; replica indices name the peers."""

    name: str
    pushes: bool
    """Whether the prefill side must send (else the decode side reads alone)."""

    def __init__(self, index: int, cache: KVCache, timeout_s: float) -> None:
        self.index, self.cache, self.timeout_s = index, cache, timeout_s
        self.bytes_moved = 0

    def send(self, dst: int, transfer_id: int, blocks: Sequence[int]) -> None:
        """Prefill side: send `blocks` of this cache to replica `dst` (pushing backends)."""
        raise NotImplementedError(f"the {self.name} connector does not push")

    @abstractmethod
    def pull(self, src: int, transfer_id: int, src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> int:
        """Decode side: bring replica `src`'s `src_blocks` into this cache's `dst_blocks`;
        the bytes moved. Raises RuntimeError naming the peer when it fails or times out."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release what the backend holds."""


class TorchKVConnector(KVConnector):
    """torch.distributed point-to-point over a gloo group of the replicas."""

    name, pushes = "torch", True

    def __init__(self, index: int, world: int, store: dist.Store, cache: KVCache,
                 timeout_s: float) -> None:
        super().__init__(index, cache, timeout_s)
        self._timeout = timedelta(seconds=timeout_s)
        # Its rendezvous waits for every replica to load; each send and recv below is
        # bounded by disagg.transfer_timeout_s instead.
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("meshserve-kv", store), index,
                                           world, timedelta(seconds=KV_STARTUP_S))

    def _packed_shape(self, n: int) -> tuple[int, ...]:
        k = self.cache[0][0]
        return (len(self.cache), 2, n, *k.shape[1:])

    def send(self, dst: int, transfer_id: int, blocks: Sequence[int]) -> None:
        packed = gather_blocks(self.cache, blocks).cpu().contiguous()
        try:
            self.group.send([packed], dst, transfer_id).wait(self._timeout)
        except RuntimeError as e:
            raise RuntimeError(f"sending {len(blocks)} KV blocks to replica {dst} failed "
                               f"(torch connector): {e}") from None
        self.bytes_moved += packed.numel() * packed.element_size()

    def pull(self, src: int, transfer_id: int, src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> int:
        k = self.cache[0][0]
        buf = torch.empty(self._packed_shape(len(dst_blocks)), dtype=k.dtype)
        try:
            self.group.recv([buf], src, transfer_id).wait(self._timeout)
        except RuntimeError as e:
            raise RuntimeError(f"receiving {len(dst_blocks)} KV blocks from replica {src} "
                               f"failed or took over disagg.transfer_timeout_s="
                               f"{self.timeout_s} s (torch connector): {e}") from None
        scatter_blocks(self.cache, dst_blocks, buf)
        n = buf.numel() * buf.element_size()
        self.bytes_moved += n
        return n


class NixlKVConnector(KVConnector):
    """NIXL READs of the prefill side's registered cache."""

    name, pushes = "nixl", False

    def __init__(self, index: int, store: dist.Store, cache: KVCache, timeout_s: float) -> None:
        super().__init__(index, cache, timeout_s)
        self.nixl = NixlKV(f"replica{index}", cache, store, timeout_s)
        self._lock = threading.Lock()  # one NIXL call at a time from this process

    def pull(self, src: int, transfer_id: int, src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> int:
        with self._lock:
            before = self.nixl.bytes_read
            self.nixl.read(f"replica{src}", src_blocks, dst_blocks, transfer_id)
            n = self.nixl.bytes_read - before
        self.bytes_moved += n
        return n

    def close(self) -> None:
        with self._lock:
            self.nixl.close()


def resolve_connector(name: str) -> str:
    """`disagg.connector` with auto resolved: nixl where it is installed, else torch."""
    if name == "auto":
        return "nixl" if nixl_available() else "torch"
    if name == "nixl" and not nixl_available():
        raise ValueError("disagg.connector=nixl: the nixl package is not installed here "
                         "(pip install nixl); allowed here: torch or auto")
    return name


def make_connector(name: str, index: int, world: int, store: dist.Store, cache: KVCache,
                   spec: KVSpec, timeout_s: float) -> KVConnector:
    """Replica `index`'s connector (every replica makes its own at start-up, together);
    first the handshake: its KV spec against replica 0's, an error naming both sides."""
    store.set(f"meshserve-kv/spec/{index}", json.dumps(spec.__dict__))
    if index != 0:
        store.wait(["meshserve-kv/spec/0"], timedelta(seconds=KV_STARTUP_S))
        first = KVSpec(**json.loads(store.get("meshserve-kv/spec/0")))
        check_handshake(first, spec)
    if resolve_connector(name) == "nixl":
        return NixlKVConnector(index, store, cache, timeout_s)
    return TorchKVConnector(index, world, store, cache, timeout_s)
