"""The communication pieces of parallel/ between two real gloo ranks (one spawn, many checks):
placement across two nodes, metadata broadcast (small and multi-buffer messages), object
and activation send/recv with several in flight, TP collectives, their counters and the
bound on a wait for a silent rank."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

RANK_PROGRAM = r'''
import glob, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from meshserve.parallel.comm.broadcast import BroadcastInbox, ObjectBroadcaster
from meshserve.parallel.comm.mesh import ParallelDims, ProcessGroups
from meshserve.parallel.comm.p2p import ObjectChannel, StageLink
from meshserve.parallel.comm.shm_names import SHM_DIR, shm_prefix

rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
T = timedelta(seconds=1)

# pp = 2 over two "nodes": stage 0 on node a, stage 1 on node b.
pp = ProcessGroups.build(ParallelDims(pp=2, world_size=2), rank=rank, node_ids=["a", "b"],
                         device_type="cpu", op_timeout=T)
assert (pp.pp_rank, pp.tp_rank) == (rank, 0) and pp.driver_rank == 0 and pp.sampler_rank == 1
assert pp.is_first_stage == (rank == 0) and pp.is_last_stage == (rank == 1)
assert pp.describe(1) == "rank 1 (pp stage 1 of 2, tp rank 0 of 1)"
assert pp.step_rings() is None and not pp.rings  # two hosts: the steps go by gloo
assert not pp.local_pids  # and no process to watch on this host

messages = [{"step": 0}, list(range(30_000)), None]  # the second needs several buffers
bcast = ObjectBroadcaster(pp.cpu_group, src=0, capacity=64, send_timeout=T)
link = StageLink(pp.pp_group, None if rank == 0 else 0, 1 if rank == 0 else None,
                 max_pending=3, timeout=T)
results = ObjectChannel(pp.result_group, max_pending=2, timeout=T)
acts = [torch.arange(2 * n * 4, dtype=torch.float32).view(2, n, 4) for n in (3, 5)]
if rank == 0:
    for m in messages:
        bcast.send(m)
    for a in acts:  # both sent before stage 1 receives either
        link.send(a[0], a[1])
    assert [results.recv(src=1) for _ in range(3)] == ["r0", {"r": 1}, [2] * 5000]
    link.drain()
else:
    inbox = BroadcastInbox(bcast)
    assert [inbox.get() for _ in messages] == messages
    inbox.join(5)
    for a in acts:
        h, r = link.recv(a.shape[1], 4, torch.float32, torch.device("cpu"))
        assert torch.equal(h, a[0]) and torch.equal(r, a[1])
    for obj in ("r0", {"r": 1}, [2] * 5000):
        results.send(obj, dst=0)
    results.drain()

# pp = 2 on one host: shared-memory rings carry what fits a slot, gloo the rest, in order.
one = ProcessGroups.build(ParallelDims(pp=2, world_size=2), rank=rank, node_ids=["a", "a"],
                          device_type="cpu", op_timeout=T, p2p_slots=2)
assert sorted(one.rings) == [("act", 0, 1), ("result", 1, 0), ("step", 0, 1)], one.rings
assert set(one.local_pids) == {1 - rank} and (one.step_rings() is not None) == (rank == 0)
dist.barrier()
assert not glob.glob(f"{SHM_DIR}/{shm_prefix()}-p2p-*")  # unlinked once both sides mapped them
act_ring = one.rings[("act", 0, 1)]
big_n = act_ring.slot_bytes // (2 * 4 * 4) + 1  # 2 x big_n x 4 floats: one slot too many
sizes = [3, big_n, 1, 2, big_n, 4]  # more small ones than slots: the sender waits for room
link = StageLink(one.pp_group, None if rank == 0 else 0, 1 if rank == 0 else None,
                 max_pending=3, timeout=T, ring_in=one.rings.get(("act", 0, 1)),
                 ring_out=one.rings.get(("act", 0, 1)) if rank == 0 else None)
results = ObjectChannel(one.result_group, max_pending=2, timeout=T,
                        ring=one.rings[("result", 1, 0)])
objs = ["small", list(range(300_000)), {"r": 2}]  # the second is bigger than a slot
acts = [torch.arange(2 * n * 4, dtype=torch.float32).view(2, n, 4) + n for n in sizes]
if rank == 0:
    for a in acts:
        link.send(a[0], a[1])
    assert act_ring.num_messages == 4  # the small ones; the big ones went through gloo
    assert [results.recv(src=1) for _ in objs] == objs
    link.drain()
else:
    for a in acts:
        time.sleep(0.05)
        h, r = link.recv(a.shape[1], 4, torch.float32, torch.device("cpu"))
        assert torch.equal(h, a[0]) and torch.equal(r, a[1])
    for obj in objs:
        results.send(obj, dst=0)
    results.drain()
dist.barrier()
if rank == 1:  # the driver never sends: the wait ends at the timeout, naming the ring
    t0 = time.monotonic()
    try:
        link.recv(2, 4, torch.float32, torch.device("cpu"))
        raise AssertionError("no timeout")
    except RuntimeError as e:
        assert "from rank 0 to rank 1" in str(e) and "within 1 s" in str(e), e
    assert time.monotonic() - t0 < 5
else:
    time.sleep(2)
dist.barrier()
for ring in one.rings.values():
    ring.close()

# tp = 2: collectives, their counters, and the wait bound when the peer stays silent.
tp = ProcessGroups.build(ParallelDims(tp=2, world_size=2), rank=rank, node_ids=["a", "a"],
                         device_type="cpu", op_timeout=T).tp
assert tp.shm is not None  # both ranks on host "a": shared memory, not gloo
x = torch.full((3, 4), float(rank + 1))
assert torch.equal(tp.all_reduce(x), torch.full((3, 4), 3.0))
for i in range(5):  # both banks, reused in turn
    y = torch.arange(6, dtype=torch.bfloat16) * (rank + 1) + i
    assert torch.equal(tp.all_reduce(y), torch.arange(6, dtype=torch.bfloat16) * 3 + 2 * i)
big = torch.full((tp.shm.slot_bytes // 4 + 1,), float(rank))  # bigger than a slot: 2 rounds
assert tp.shm.fits(big) and torch.equal(tp.all_reduce(big), torch.ones_like(big))
g = tp.gather(torch.full((2, 3), float(rank)), dim=-1)
assert (g is None) == (rank == 1)
if g is not None:
    assert torch.equal(g, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], -1))
assert not tp.shm.fits_gather(big)  # a gather part bigger than a slot goes through gloo
g = tp.gather(torch.full_like(big, float(rank)), dim=0)
if g is not None:
    assert g.shape == (2 * big.numel(),) and g[-1].item() == 1.0 and g[0].item() == 0.0
c = tp.counters
assert (c.num_all_reduce, c.num_gather, c.gather_bytes) == (7, 2, 24 + big.numel() * 4)
assert c.all_reduce_bytes == 48 + 5 * 12 + big.numel() * 4
assert c.comm_s > 0
dist.barrier()
if rank == 0:
    t0 = time.monotonic()
    try:
        tp.all_reduce(torch.ones(1))  # rank 1 never joins
        raise AssertionError("no timeout")
    except RuntimeError as e:
        assert "timed out" in str(e).lower(), e
    assert time.monotonic() - t0 < 5
else:
    time.sleep(3)
dist.destroy_process_group()
print("ok", rank)
'''


def test_two_gloo_ranks(run_ranks) -> None:
    run_ranks(RANK_PROGRAM, 2, 120)
