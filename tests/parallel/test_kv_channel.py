"""KV blocks between two real gloo ranks: gathered from one paged cache, sent a layer at a
time, placed into other block ids of the other cache as each layer lands; the byte
counters; a bounded wait on a silent peer."""

from __future__ import annotations

import pytest

from tests.parallel.conftest import RunRanks

pytestmark = pytest.mark.slow

RANK_PROGRAM = r'''
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from meshserve.engine.worker.kv_blocks import gather_blocks, scatter_blocks
from meshserve.parallel.comm.kv_channel import KVChannel

rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
g = torch.Generator().manual_seed(0)
cache = [(torch.randn(12, 4, 2, 8, generator=g), torch.randn(12, 4, 2, 8, generator=g))
         for _ in range(3)]  # the same on both ranks: rank 1 zeroes its copy
ch = KVChannel(1 - rank, None, torch.float32, torch.device("cpu"),
               timeout=timedelta(seconds=1))
src_blocks, dst_blocks = [7, 2, 9], [0, 5, 11]
if rank == 0:
    packed = gather_blocks(cache, src_blocks)
    ch.send(41, [packed[layer] for layer in range(3)])
    assert ch.bytes_sent == 3 * 2 * 3 * 4 * 2 * 8 * 4
    time.sleep(3)  # silent while rank 1 waits for more
else:
    mine = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in cache]
    placed = []

    def place(layer, t):
        placed.append(layer)
        one = [mine[layer]]
        scatter_blocks(one, dst_blocks, t.unsqueeze(0))

    tid, layers = ch.receive(place)
    assert tid == 41 and placed == [0, 1, 2] and len(layers) == 3
    assert ch.bytes_received == 3 * 2 * 3 * 4 * 2 * 8 * 4
    for layer in range(3):
        for which in (0, 1):
            for s, d in zip(src_blocks, dst_blocks):
                assert torch.equal(mine[layer][which][d], cache[layer][which][s])
            assert not mine[layer][which][1].any()  # blocks not sent stay as they were
    t0 = time.monotonic()
    try:  # nothing more comes: the wait is bounded
        ch.receive()
    except RuntimeError as e:
        assert "timed out" in str(e).lower() or "timeout" in str(e).lower(), e
    else:
        raise AssertionError("a receive from a silent peer returned")
    assert time.monotonic() - t0 < 2.5
print("ok", rank, flush=True)
os._exit(0)  # the pair is broken after a timed-out wait: no collective shutdown
'''


def test_kv_blocks_cross_a_gloo_pair_layer_by_layer(run_ranks: RunRanks) -> None:
    run_ranks(RANK_PROGRAM, 2, 120.0)
