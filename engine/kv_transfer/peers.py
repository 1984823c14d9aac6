"""Where a run's KV ranks find each other: every replica's ranks as the KV store lists
them, the run's name on its host, the keys grants and listings are announced under, and
the handshake that compares the two sides' KV specs before any block moves."""

from __future__ import annotations

import bisect
import json
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from meshserve.engine.kv_transfer.handshake import KVSpec, check_handshake
from meshserve.engine.kv_transfer.listing import Listed
from meshserve.engine.kv_transfer.pieces import (
    RankKV,
)
from meshserve.engine.kv_transfer.shm_channel import sweep
from meshserve.parallel.comm.shm_names import shm_prefix as name_prefix
from meshserve.parallel.comm.store_bytes import store_compare_set

KV_STARTUP_S = 300.0
"""Longest a rank waits at start-up for the others' handshake and group (they load
their models meanwhile); one transfer has disagg.transfer_timeout_s."""


class KVPeers:
    """Every replica's ranks as the KV store lists them (each rank publishes its own)."""

    def __init__(self, store: dist.Store, sizes: Sequence[int],
                 open_store: Callable[[], dist.Store] | None = None) -> None:
        self.store, self.sizes, self.open_store = store, list(sizes), open_store
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._ranks: dict[int, list[RankKV]] = {}
        self.lock = threading.Lock()
        """Held by every call on `store`: the main thread and the transfer threads share
        its one connection, whose replies would cross otherwise. A thread that waits on
        the store opens a connection of its own (`open_store`)."""

    @property
    def world(self) -> int:
        return sum(self.sizes)

    def replica_of(self, rank: int) -> int:
        """The replica global rank `rank` belongs to."""
        return bisect.bisect_right(self.offsets, rank) - 1

    def publish(self, me: RankKV) -> None:
        with self.lock:
            self.store.set(f"meshserve-kv/rank/{me.rank}", json.dumps(
                {"layers": list(me.layers), "heads": list(me.heads)}))

    def ranks(self, replica: int) -> list[RankKV]:
        """Replica `replica`'s ranks (waiting for them to publish, at first)."""
        with self.lock:
            return self._ranks_of(replica)

    def _ranks_of(self, replica: int) -> list[RankKV]:
        if replica not in self._ranks:
            first = self.offsets[replica]
            keys = [f"meshserve-kv/rank/{g}" for g in range(first, first + self.sizes[replica])]
            self.store.wait(keys, timedelta(seconds=KV_STARTUP_S))
            found = [json.loads(self.store.get(k)) for k in keys]
            self._ranks[replica] = [RankKV(first + i, tuple(f["layers"]), tuple(f["heads"]))
                                    for i, f in enumerate(found)]
        return self._ranks[replica]

    # A read of a prefill replica's KV is begun as its import is sent (pulling
    # connectors); the prefill replica announces the grant here, where the decode replica
    # looks for it, so neither waits for the front to relay it.

    def announce_grant(self, transfer_id: int) -> None:
        with self.lock:
            self.store.set(_grant_key(transfer_id), "1")

    def grant_announced(self, transfer_id: int) -> bool:
        with self.lock:
            return grant_announced(self.store, transfer_id)

    # Streamed prompts' blocks: a prefill replica lists, for each decode replica, the
    # blocks of every prompt it streams there computed so far, with their layers written
    # (pinned until the read ends: engine/kv_transfer/listing.py), under one key, so a decode
    # replica reads one key per prefill replica however many prompts it waits on.

    def publish_listed(self, src: int, dst: int, listed: dict[int, Listed]) -> None:
        """Prefill replica `src`: what it lists for decode replica `dst`, by transfer id."""
        value = json.dumps({k: v.to_json() for k, v in listed.items()})
        with self.lock:
            self.store.set(_listed_key(src, dst), value)

    def listed(self, src: int, dst: int) -> dict[int, Listed]:
        """What prefill replica `src` lists for decode replica `dst`: the blocks computed
        so far of each prompt it streams there (and their layers written), by transfer id.
        One read that never waits (a get would wait for a key not yet set)."""
        with self.lock:
            value = store_compare_set(self.store, _listed_key(src, dst), _ABSENT, _ABSENT)
        if value == _ABSENT:
            return {}
        return {int(k): Listed.from_json(v) for k, v in json.loads(value).items()}


_ABSENT = b"\x00"
"""compare_set's answer for a key not in the store (it sets nothing then)."""


RUN_KEY = "meshserve-kv/run"
"""A name for this run's KV world, unique on its host: its shared-memory files carry it."""


def name_run(store: dist.Store) -> str:
    """The front, before any replica makes its connector: name the run."""
    token = uuid.uuid4().hex[:12]
    store.set(RUN_KEY, token)
    return token


def shm_prefix(token: str) -> str:
    """The start of every shared-memory file name of run `token` (under SHM_DIR)."""
    return f"{name_prefix()}-kv-{token}-"


def sweep_run(token: str) -> int:
    """Remove what run `token` left in shared memory (channels whose sender never came,
    markers of ranks that died); how many went."""
    return sweep(shm_prefix(token))


def _grant_key(transfer_id: int) -> str:
    return f"meshserve-kv/granted/{transfer_id}"


def _listed_key(src: int, dst: int) -> str:
    return f"meshserve-kv/listed/{src}/{dst}"


def forget_grant(store: dist.Store, transfer_id: int) -> None:
    """The front: nobody will look for this read's announced grant again."""
    store.delete_key(_grant_key(transfer_id))


def listed_blocks(store: dist.Store, src: int, dst: int) -> dict[str, list[int]]:
    """What prefill replica `src` lists for decode replica `dst` now ({}: nothing)."""
    if not store.check([_listed_key(src, dst)]):
        return {}
    return json.loads(store.get(_listed_key(src, dst)))


def grant_announced(store: dist.Store, transfer_id: int) -> bool:
    """Whether this read's grant is (still) announced in the KV store."""
    return store.check([_grant_key(transfer_id)])



def handshake(store: dist.Store, index: int, spec: KVSpec) -> None:
    """Replica `index`'s KV spec against replica 0's: an error naming both sides."""
    store.set(f"meshserve-kv/spec/{index}", json.dumps(spec.__dict__))
    if index != 0:
        store.wait(["meshserve-kv/spec/0"], timedelta(seconds=KV_STARTUP_S))
        first = KVSpec(**json.loads(store.get("meshserve-kv/spec/0")))
        check_handshake(first, spec)
