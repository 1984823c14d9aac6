"""A launched replica's own world: its keys under its namespace in the launched world's
store, where connections of their own (a rank's KV thread) find them too."""

from __future__ import annotations

import dataclasses
import socket
from datetime import timedelta

import pytest

from meshserve.parallel.comm.discovery import LaunchEnv, LaunchError
from meshserve.parallel.comm.ranks import launcher_store, launcher_store_address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_replica_world_keeps_its_keys_under_its_namespace() -> None:
    world = LaunchEnv(launcher="env", rank=0, world_size=1, local_rank=0, local_world_size=1,
                      node_rank=0, num_nodes=1, master_addr="127.0.0.1",
                      master_port=_free_port())
    replica = dataclasses.replace(world, world=world, namespace="replica1")
    timeout = timedelta(seconds=10)
    launcher_store(replica, timeout).set("k", "replica")
    launcher_store(world, timeout).set("k", "world")
    assert launcher_store_address(replica).open(timeout).get("k") == b"replica"
    assert launcher_store_address(world).open(timeout).get("k") == b"world"
    assert launcher_store(replica, timeout).get("k") == b"replica"


def test_a_replica_env_counts_its_own_ranks_on_the_worlds_nodes() -> None:
    world = LaunchEnv(launcher="torchrun", rank=3, world_size=4, local_rank=1,
                      local_world_size=2, node_rank=1, num_nodes=2, master_addr="h",
                      master_port=29500)
    # Rank 3 is a one-rank replica's; its node and local rank stay the world's.
    mine = dataclasses.replace(world, rank=0, world_size=1, world=world, namespace="replica2")
    assert (mine.node_id, mine.local_rank, mine.is_worker) == ("node1", 1, False)
    with pytest.raises(LaunchError, match="local world size=2 is invalid"):
        dataclasses.replace(world, rank=0, world_size=1)  # a world of one rank has one
    with pytest.raises(LaunchError, match="node count=5 is invalid"):
        dataclasses.replace(mine, num_nodes=5)  # more nodes than the launched world's ranks
