"""Which connector a rank makes (disagg.connector resolved) and making it."""

from __future__ import annotations

from meshserve.engine.kv_transfer.blocks import KVCache
from meshserve.engine.kv_transfer.connector import KVConnector
from meshserve.engine.kv_transfer.nixl_agent import nixl_available
from meshserve.engine.kv_transfer.nixl_connector import NixlKVConnector
from meshserve.engine.kv_transfer.peers import KVPeers
from meshserve.engine.kv_transfer.pieces import (
    RankKV,
)
from meshserve.engine.kv_transfer.torch_connector import TorchKVConnector


def resolve_connector(name: str) -> str:
    """`disagg.connector` with auto resolved: nixl where it is installed, else torch."""
    if name == "auto":
        return "nixl" if nixl_available() else "torch"
    if name == "nixl" and not nixl_available():
        raise ValueError("disagg.connector=nixl: the nixl package is not installed here "
                         "(pip install nixl); allowed here: torch or auto")
    return name


def make_connector(name: str, me: RankKV, replica: int, cache: KVCache, peers: KVPeers,
                   timeout_s: float, shm: bool = True, wire: str = "auto") -> KVConnector:
    """This rank's connector (every rank of every replica makes its own at start-up,
    together); `shm`: the torch connector's shared memory between processes on one host;
    `wire`: its torch.distributed wire (`disagg.torch_wire`)."""
    peers.publish(me)
    if _connector_class(name) is TorchKVConnector:
        return TorchKVConnector(me, replica, cache, peers, timeout_s, shm, wire)
    return NixlKVConnector(me, replica, cache, peers, timeout_s)


def _connector_class(name: str) -> type[TorchKVConnector] | type[NixlKVConnector]:
    return NixlKVConnector if resolve_connector(name) == "nixl" else TorchKVConnector
