"""KV blocks read over NIXL (UCX) from another process's paged cache into blocks this
side allocated; the sender is notified (and only counts it) when its blocks were read."""

from __future__ import annotations

import pytest
from helpers.run_ranks import RunRanks

from meshserve.engine.kv_transfer.nixl_agent import nixl_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not nixl_available(), reason="needs nixl (pip install nixl)")]

RANK_PROGRAM = r'''
import os, sys, time
os.environ.setdefault("UCX_TLS", "tcp,self,sm")
import torch
import torch.distributed as dist
from meshserve.engine.kv_transfer.blocks import gather_blocks
from meshserve.engine.kv_transfer.nixl_agent import NixlKV

rank, store_path = int(sys.argv[1]), sys.argv[2]
store = dist.FileStore(store_path, 2)
g = torch.Generator().manual_seed(0)
src = [(torch.randn(12, 4, 2, 8, generator=g), torch.randn(12, 4, 2, 8, generator=g))
       for _ in range(3)]
cache = src if rank == 0 else [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
kv = NixlKV(f"r{rank}", cache, store, timeout_s=20)
if rank == 0:  # the prefill side: NIXL notifies it when the READ has landed
    deadline = time.monotonic() + 30
    while kv.num_notifs < 1:
        assert time.monotonic() < deadline, "no notification"
        time.sleep(0.01)
    store.set("finished", b"1")
else:
    kv.read("r0", [7, 2, 9], [0, 5, 11], transfer_id=12)
    assert torch.equal(gather_blocks(cache, [0, 5, 11]), gather_blocks(src, [7, 2, 9]))
    assert not gather_blocks(cache, [1, 2, 3]).any()  # nothing else was written
    assert kv.bytes_read == 3 * 2 * 3 * (4 * 2 * 8 * 4)
    store.wait(["finished"])
kv.close()
print("ok", rank, flush=True)
'''


def test_nixl_reads_blocks_into_the_ones_allocated_here(run_ranks: RunRanks) -> None:
    run_ranks(RANK_PROGRAM, 2, 120.0)
