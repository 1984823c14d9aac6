"""KV transfers of a multi-rank replica: its driver fans each pull out to every rank.

Each rank holds its own share of the replica's KV (engine/kv_transfer/pieces.py), so a
pull into a tp x pp replica is one pull per rank; out of one, each rank's connector
answers for its own share by itself. The driver's KV hand-off decides (engine/replicas/kv_handoff.py);
`FannedOut` runs the driver's own part in the calling thread and tells every other rank
through the replica's store, then waits for all of them. A TCP store connection is not
safe to share between threads that wait on it, so each transfer takes a connection of its
own from a pool (opening one per transfer costs a connect, at times seconds of it). On
every other rank a thread, `serve_kv`, waits for where the KV world is, makes that rank's
connector and runs each pull it is told in a thread of its own, so pulls overlap there as
on the driver. Steps never wait for it: a transfer touches only blocks the driver's block
manager holds pinned for it.
"""

from __future__ import annotations

import itertools
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from meshserve.engine.kv_transfer.blocks import KVCache
from meshserve.engine.kv_transfer.connector import KVConnector, ReadStillActive
from meshserve.engine.kv_transfer.factory import make_connector
from meshserve.engine.kv_transfer.peers import KV_STARTUP_S, KVPeers
from meshserve.engine.kv_transfer.pieces import RankKV
from meshserve.parallel.comm.discovery import LaunchEnv
from meshserve.parallel.comm.ranks import StoreAddress, launcher_store_address
from meshserve.parallel.comm.store_bytes import store_set

CONNECT_KEY = "meshserve-kv-rank/connect"
"""Where the driver tells its ranks where the KV world is (a pickled KVWorld)."""


@dataclass(frozen=True, slots=True)
class KVWorld:
    """The driver to its other ranks, once: where the KV world is and how to join it."""

    at: StoreAddress
    replica: int
    sizes: list[int]
    """Ranks of every replica."""
    connector: str
    timeout_s: float
    shm: bool
    wire: str


@dataclass(frozen=True, slots=True)
class Pull:
    """The driver to a rank: run your part of this pull (KVConnector.pull's arguments)."""

    src: int
    transfer_id: int
    src_blocks: list[int]
    dst_blocks: list[int]
    layers: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class StopServing:
    """The driver to a rank: close the connector; no more pulls."""


@dataclass(frozen=True, slots=True)
class PullDone:
    """A rank to the driver: its part of a pull moved `nbytes`, or failed."""

    nbytes: int
    error: str | None
    still_writing: bool = False
    """The failed part may still write into its blocks (ReadStillActive)."""

_IDLE_WAIT_S = 3600.0


def _cmd_key(rank: int, seq: int) -> str:
    return f"meshserve-kv-rank/cmd/{rank}/{seq}"


def _done_key(rank: int, seq: int) -> str:
    return f"meshserve-kv-rank/done/{rank}/{seq}"


class StorePool:
    """Client connections to one store, each used by one thread at a time."""

    def __init__(self, open_store: Callable[[], dist.Store]) -> None:
        self.open_store = open_store
        self._idle: list[dist.Store] = []
        self._lock = threading.Lock()

    @contextmanager
    def connection(self) -> Iterator[dist.Store]:
        with self._lock:
            store = self._idle.pop() if self._idle else None
        if store is None:
            store = self.open_store()
        yield store
        with self._lock:
            self._idle.append(store)


class FannedOut(KVConnector):
    """The driver's connector, with every transfer also run by the replica's other ranks."""

    def __init__(self, own: KVConnector, open_store: Callable[[], dist.Store],
                 num_ranks: int) -> None:
        self.own, self.num_ranks = own, num_ranks
        self.store = open_store()  # (for the commands, under the lock)
        self._waits = StorePool(open_store)
        self.name = own.name
        self.me, self.replica, self.cache, self.peers = own.me, own.replica, own.cache, own.peers
        self.timeout_s = own.timeout_s
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def pull(self, src: int, transfer_id: int, src_blocks: Sequence[int],
             dst_blocks: Sequence[int], layers: tuple[int, int] | None = None) -> int:
        cmd = Pull(src, transfer_id, list(src_blocks), list(dst_blocks), layers)
        with self._lock:  # every rank is told the transfers in one order
            seq = next(self._seq)
            for r in range(1, self.num_ranks):
                store_set(self.store, _cmd_key(r, seq), pickle.dumps(cmd))
        total = self.own.pull(src, transfer_id, src_blocks, dst_blocks, layers)
        self.bytes_moved = self.own.bytes_moved  # (this rank's, as any connector counts)
        with self._waits.connection() as store:
            for r in range(1, self.num_ranks):
                key = _done_key(r, seq)
                try:
                    store.wait([key], timedelta(seconds=self.timeout_s))
                except RuntimeError:  # its READ may still be writing: keep the blocks
                    raise ReadStillActive(f"rank {r} of replica {self.replica} did not "
                                          "finish its part of a KV transfer within "
                                          f"disagg.transfer_timeout_s={self.timeout_s} s"
                                          ) from None
                done: PullDone = pickle.loads(store.get(key))
                store.delete_key(key)
                if done.error is not None:
                    error = ReadStillActive if done.still_writing else RuntimeError
                    raise error(f"rank {r} of replica {self.replica}: {done.error}")
                total += done.nbytes
        return total

    def close(self) -> None:
        with self._lock:
            seq = next(self._seq)
            for r in range(1, self.num_ranks):
                store_set(self.store, _cmd_key(r, seq), pickle.dumps(StopServing()))
        self.own.close()


def tell_ranks(store: dist.Store, kv_world: StoreAddress, replica: int, sizes: Sequence[int],
               connector: str, timeout_s: float, shm: bool, wire: str) -> None:
    """The driver: where the KV world's store is, for its other ranks' `serve_kv` threads."""
    store_set(store, CONNECT_KEY, pickle.dumps(KVWorld(kv_world, replica, list(sizes), connector,
                                                timeout_s, shm, wire)))


def serve_kv(open_store: Callable[[], dist.Store], rank: int, first_layer: int,
             num_layers: int, tp_rank: int, tp: int, num_kv_heads: int, cache: KVCache) -> None:
    """A non-driver rank's KV thread: join the KV world, then run what the driver says
    until told to stop (or the replica's store is gone)."""
    store = open_store()
    store.wait([CONNECT_KEY], timedelta(seconds=KV_STARTUP_S))
    world: KVWorld = pickle.loads(store.get(CONNECT_KEY))
    peers = KVPeers(world.at.open(timedelta(seconds=KV_STARTUP_S)), world.sizes,
                    store_opener(world.at))
    me = RankKV.of(peers.offsets[world.replica] + rank,
                   (first_layer, first_layer + num_layers), tp_rank, tp, num_kv_heads)
    connector = make_connector(world.connector, me, world.replica, cache, peers,
                               world.timeout_s, world.shm, world.wire)
    results = StorePool(open_store)
    for seq in itertools.count():
        key = _cmd_key(rank, seq)
        while True:
            try:
                store.wait([key], timedelta(seconds=_IDLE_WAIT_S))
                break
            except RuntimeError as e:
                if "timeout" not in str(e).lower():
                    return  # the store is gone: the replica is ending
        cmd: Pull | StopServing = pickle.loads(store.get(key))
        store.delete_key(key)
        if isinstance(cmd, StopServing):
            connector.close()
            return
        threading.Thread(target=_run, args=(results, rank, seq, connector, cmd),
                         name=f"meshserve-kv-pull-{seq}", daemon=True).start()


def _run(results: StorePool, rank: int, seq: int, connector: KVConnector, cmd: Pull) -> None:
    try:
        done = PullDone(connector.pull(cmd.src, cmd.transfer_id, cmd.src_blocks,
                                       cmd.dst_blocks, cmd.layers), None)
    except Exception as e:  # noqa: BLE001 - reported to the driver
        done = PullDone(0, f"{type(e).__name__}: {e}", isinstance(e, ReadStillActive))
    with results.connection() as store:
        store_set(store, _done_key(rank, seq), pickle.dumps(done))


def start_kv_thread(replica_store: StoreAddress, rank: int, first_layer: int, num_layers: int,
                    tp_rank: int, tp: int, num_kv_heads: int, cache: KVCache
                    ) -> threading.Thread:
    """Start `serve_kv` on connections of its own to the replica's store (its waits then
    never hold up the rank's other uses of the store). The driver tells it to stop
    (StopServing) before it stops the rank's steps: join it before the process exits, so
    no store wait is cut off mid-call at interpreter shutdown."""
    thread = threading.Thread(target=serve_kv, args=(store_opener(replica_store), rank,
                                                     first_layer, num_layers, tp_rank, tp,
                                                     num_kv_heads, cache),
                              name="meshserve-kv-rank", daemon=True)
    thread.start()
    return thread


def replica_store_address(env: LaunchEnv) -> StoreAddress:
    """Where a replica's driver and its other ranks meet for KV commands: a launched
    replica's namespace in the launched world's store, else (self-spawned ranks) their
    own run's store."""
    if env.world is not None:
        return launcher_store_address(env)
    return StoreAddress(env.master_addr, env.master_port)


def store_opener(address: StoreAddress) -> Callable[[], dist.Store]:
    """Opens a new client connection to the store at `address` on each call."""
    return lambda: address.open(timedelta(seconds=KV_STARTUP_S))
