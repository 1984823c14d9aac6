"""How KV blocks move between replicas: one interface, two backends, one rank's end each.

Every rank of every replica that moves KV has a connector over its own part of the cache
(its pipeline stage's layers, its tensor-parallel share of the heads): a transfer between
replicas of different layouts moves, for each pair of ranks, the piece both hold
(engine/kv_transfer/pieces.py), so heads are resharded and stages gathered on the way.
The decode side has allocated the blocks the KV lands in before any byte moves, and the
prefill side holds the blocks it reads from under a lease (engine/replicas/kv_handoff.py), so a
transfer never touches a block anything else may use. Calls run off the main thread (one
thread per transfer) and are bounded by disagg.transfer_timeout_s.

- `nixl`: the decode rank READs each source rank's registered cache straight into its
  own blocks over UCX (shared memory or TCP between processes' host memory; NVLink or
  InfiniBand between GPUs); the prefill side does nothing.
- `torch`: the decode rank asks each source rank for its piece (through the KV store), and
  a thread of the source rank answers, a layer at a time: the decode rank writes each
  layer into its cache as it lands, so packing, the wire and placing overlap (a GPU cache
  is staged through host memory). Between processes on one host a piece goes through the
  two ranks' channel in shared memory (engine/kv_transfer/shm_channel.py: packed straight into
  it, placed straight from it); otherwise torch.distributed point-to-point carries it:
  over a gloo group of every rank of every replica, or over a group per pair of ranks
  whose messages both sides issue in one order (NCCL, straight between GPU caches).

Either way the decode side pulls: it reads what the prefill side was told to grant, as
soon as it has its blocks, and the prefill side's engine takes no part.

Ranks find each other (where each one's KV sits, NIXL metadata, the KV spec the
handshake compares) through one TCP store the front hosts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from meshserve.engine.kv_transfer.blocks import KVCache
from meshserve.engine.kv_transfer.peers import KVPeers
from meshserve.engine.kv_transfer.pieces import (
    Piece,
    RankKV,
    pieces_for,
)


class ReadStillActive(RuntimeError):
    """A transfer failed (it timed out) and may still be writing into its destination
    blocks: it could be neither cancelled nor seen to end. Those blocks must never be
    reused; the caller keeps them out of use."""


class KVConnector(ABC):
    """One rank's end of KV traffic: replica indices name the peers."""

    name: str

    def __init__(self, me: RankKV, replica: int, cache: KVCache, peers: KVPeers,
                 timeout_s: float) -> None:
        self.me, self.replica, self.cache, self.peers = me, replica, cache, peers
        self.timeout_s = timeout_s
        self.bytes_moved = 0

    @abstractmethod
    def pull(self, src: int, transfer_id: int, src_blocks: Sequence[int],
             dst_blocks: Sequence[int], layers: tuple[int, int] | None = None) -> int:
        """Decode side: bring this rank's pieces of replica `src`'s `src_blocks` into this
        cache's `dst_blocks` (`layers`: of the global layers [start, stop) only); the
        bytes moved. Raises RuntimeError naming the peer when it fails or times out."""

    def _incoming(self, src: int) -> list[Piece]:
        return pieces_for(self.peers.ranks(src), self.me)

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release what the backend holds."""
