"""Shared-memory AllReduce and gather between three real processes: sums equal gloo's
(also over several slot-sized rounds), gathers land in rank order, every rank
gets the same bits, nothing is left in /dev/shm, a wrong group falls back to gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshserve.parallel.comm import shm_allreduce
from meshserve.parallel.comm.shm_names import SHM_DIR, shm_prefix

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not shm_allreduce.supported(), reason="x86-64 only")]

RANK_PROGRAM = r'''
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
from meshserve.parallel.comm.shm_allreduce import ShmAllReduce

rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 3), rank=rank, world_size=3,
                        timeout=timedelta(seconds=60))
group = dist.new_group([0, 1, 2], backend="gloo")
shm = ShmAllReduce(group, rank, 3, timeout=timedelta(seconds=10), slot_bytes=1 << 16)
gen = torch.Generator().manual_seed(rank)
for step in range(20):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(37, 5, generator=gen).to(dtype)
        want = x.clone().float()
        dist.all_reduce(want, group=group)
        got = shm.all_reduce(x.clone())
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
        bits = [None] * 3
        dist.all_gather_object(bits, got.view(torch.uint8).tolist(), group=group)
        assert bits[0] == bits[1] == bits[2], "ranks disagree"
# 200 KiB > 64 KiB slot: summed in four rounds, still equal to gloo's sum
big = torch.randn(100, 512, generator=gen)
want = big.clone()
dist.all_reduce(want, group=group)
torch.testing.assert_close(shm.all_reduce(big.clone()), want)
# gathers, back to back and mixed with sums: rank 1 collects, the others move on at once
for step in range(10):
    part = torch.full((4, 3), float(10 * step + rank))
    got = shm.gather(part, dim=-1, dst=1)
    if rank == 1:
        assert got.shape == (4, 9), got.shape
        assert got[0].tolist() == [float(10 * step + r) for r in range(3) for _ in range(3)]
    else:
        assert got is None
    if step % 3 == 0:
        total = shm.all_reduce(torch.ones(5))
        assert total.tolist() == [3.0] * 5
assert shm.fits(torch.zeros(1 << 15)) and not shm.fits_gather(torch.zeros(1 << 15))
assert not shm.fits(torch.zeros(8, 8)[:, ::2])  # not contiguous
assert not shm.fits(torch.zeros(4, dtype=torch.int64))
shm.close()
dist.barrier()
dist.destroy_process_group()
print("ok", rank)
'''


def test_three_ranks_sum_like_gloo_and_leave_nothing(run_ranks) -> None:
    mine = f"{shm_prefix()}-ar-*"  # (this test worker's: the others' come and go)
    before = set(Path(SHM_DIR).glob(mine))
    for err in run_ranks(RANK_PROGRAM, 3, 180):
        assert "leaked" not in err, err[-2000:]
    assert set(Path(SHM_DIR).glob(mine)) == before
