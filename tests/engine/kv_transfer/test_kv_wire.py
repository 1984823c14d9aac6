"""The torch connector's wire: auto resolved to gloo_pairs, a wire this rank
cannot use refused naming the field, and ranks that resolved it differently stopped at
start-up with an error naming each one's, not left waiting for a group that never forms."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from meshserve.engine.kv_transfer.peers import KVPeers
from meshserve.engine.kv_transfer.pieces import RankKV
from meshserve.engine.kv_transfer.torch_connector import TorchKVConnector, resolve_wire

CPU_CACHE = [(torch.zeros(4, 2, 1, 2), torch.zeros(4, 2, 1, 2))]


def test_auto_is_gloo_pairs_and_nccl_needs_a_gpu() -> None:
    assert resolve_wire("auto", CPU_CACHE) == "gloo_pairs"
    assert resolve_wire("gloo", CPU_CACHE) == "gloo"
    assert resolve_wire("gloo_pairs", CPU_CACHE) == "gloo_pairs"
    with pytest.raises(ValueError, match=r"disagg.torch_wire=nccl: the KV cache is on cpu"):
        resolve_wire("nccl", CPU_CACHE)
    with pytest.raises(ValueError, match=r"disagg.torch_wire='mpi': allowed"):
        resolve_wire("mpi", CPU_CACHE)


def test_ranks_on_different_wires_fail_at_start_naming_each(
        open_store: Callable[[], dist.Store]) -> None:
    errors: dict[int, str] = {}

    def start(rank: int, wire: str) -> None:
        peers = KVPeers(open_store(), [1, 1], open_store)
        try:
            TorchKVConnector(RankKV(rank, (0, 1), (0, 1)), rank, CPU_CACHE, peers, 5.0,
                             shm=False, wire=wire)
        except ValueError as e:
            errors[rank] = str(e)

    threads = [threading.Thread(target=start, args=a) for a in ((0, "gloo"), (1, "gloo_pairs"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(errors) == [0, 1]
    assert "rank 0: gloo, rank 1: gloo_pairs" in errors[0] and errors[0] == errors[1]
