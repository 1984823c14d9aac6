"""The NIXL connector: the decode rank READs each source rank's registered cache
straight into its own blocks over UCX; the prefill side does nothing."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from meshserve.engine.kv_transfer.blocks import KVCache
from meshserve.engine.kv_transfer.connector import KVConnector
from meshserve.engine.kv_transfer.nixl_agent import NixlKV
from meshserve.engine.kv_transfer.peers import KVPeers
from meshserve.engine.kv_transfer.pieces import (
    RankKV,
    restrict,
)


class NixlKVConnector(KVConnector):
    """NIXL READs of the source ranks' registered caches."""

    name = "nixl"

    def __init__(self, me: RankKV, replica: int, cache: KVCache, peers: KVPeers,
                 timeout_s: float) -> None:
        super().__init__(me, replica, cache, peers, timeout_s)
        # (the store connection is the peers', so its calls take their lock)
        self.nixl = NixlKV(f"kv{me.rank}", cache, peers.store, timeout_s, peers.lock)
        self._lock = threading.Lock()  # one NIXL call at a time from this process

    def pull(self, src: int, transfer_id: int, src_blocks: Sequence[int],
             dst_blocks: Sequence[int], layers: tuple[int, int] | None = None) -> int:
        with self._lock:
            pieces = restrict(self._incoming(src), layers)
            before = self.nixl.bytes_read
            for p in pieces:
                self.nixl.read(f"kv{p.src.rank}", src_blocks, dst_blocks, transfer_id,
                               remote_part=p.local(p.src), local_part=p.local(self.me))
            n = self.nixl.bytes_read - before
        self.bytes_moved += n
        return n

    def close(self) -> None:
        with self._lock:
            self.nixl.close()
