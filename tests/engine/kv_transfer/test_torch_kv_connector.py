"""The torch connector between real ranks of two replicas of different layouts, through
shared memory and through gloo: two tensor-parallel ranks pull from a pipeline of two
stages, whose connectors answer by themselves, a layer at a time, the first layer asked
for before the others; every destination rank ends with exactly its layers and heads of
the blocks asked for, in its own block ids; the
byte counts on both sides; a bounded wait on a peer that stopped answering; over pair
groups, a pull whose answer comes after it timed out, and the next pull whole and right
on the pairs' next groups; nothing left in shared memory."""

from __future__ import annotations

import glob
import uuid

import pytest
from helpers.run_ranks import RunRanks

from meshserve.engine.kv_transfer.peers import shm_prefix, sweep_run
from meshserve.parallel.comm.discovery import free_port
from meshserve.parallel.comm.shm_allreduce import supported
from meshserve.parallel.comm.shm_names import SHM_DIR

pytestmark = pytest.mark.slow

RANK_PROGRAM = r'''
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from meshserve.engine.kv_transfer.factory import make_connector
from meshserve.engine.kv_transfer.peers import RUN_KEY, KVPeers
from meshserve.engine.kv_transfer.pieces import RankKV

rank = int(sys.argv[1])
L, BLOCKS, BS, H, D = 3, 12, 4, 4, 8
full = torch.randn(L, 2, BLOCKS, BS, H, D, generator=torch.Generator().manual_seed(0))
ranks = [RankKV(0, (0, 2), (0, 4)), RankKV(1, (2, 3), (0, 4)),  # replica 0: pp=2
         RankKV(2, (0, 3), (0, 2)), RankKV(3, (0, 3), (2, 4))]  # replica 1: tp=2
me = ranks[rank]
h = slice(*me.heads)
cache = [(full[i, 0][:, :, h].clone(), full[i, 1][:, :, h].clone()) for i in range(*me.layers)]
SHM, WIRE, TOKEN, PORT = @SHM@, "@WIRE@", "@TOKEN@", @PORT@
wait = timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", PORT, 4, rank == 0, timeout=wait)
def connect() -> dist.Store:
    return dist.TCPStore("127.0.0.1", PORT, is_master=False, timeout=wait)
peers = KVPeers(store, [2, 2], connect)
store = connect()  # (the test's own waits never hold up the connector's calls)
if rank == 0:
    peers.store.set(RUN_KEY, TOKEN)
conn = make_connector("torch", me, rank // 2, cache, peers, 1.0, shm=SHM, wire=WIRE)
PAIRS = WIRE == "gloo_pairs"
answer = conn._answer_one
def answer_late(ask: bytes) -> None:  # transfer 8 is answered after its pull timed out
    if int.from_bytes(ask[16:24], "little") == 8:
        time.sleep(1.5)
    answer(ask)
conn._answer_one = answer_late
src_blocks, dst_blocks = [7, 2, 9], [0, 5, 11]
per_block = BS * 2 * D * 4  # tokens x heads x head dim x fp32, per layer, K or V
if rank < 2:  # a prefill rank: its connector answers by itself
    want = (me.layers[1] - me.layers[0]) * 2 * len(src_blocks) * 2 * per_block
    store.wait(["pulled-2", "pulled-3"], wait)
    deadline = time.monotonic() + 5
    while conn.bytes_moved < want:
        assert time.monotonic() < deadline, (conn.bytes_moved, want)
        time.sleep(0.01)
    conn.close()  # it answers no more: silent while the destination waits
    store.add("closed", 1)
    store.wait(["done-2", "done-3"], wait)
else:
    def zero() -> None:
        for k, v in cache:
            k.zero_()
            v.zero_()

    def landed() -> None:
        for layer, (k, v) in enumerate(cache):
            for which, t in enumerate((k, v)):
                want = full[layer, which][src_blocks][:, :, h]
                assert torch.equal(t[dst_blocks], want), (layer, which)
                rest = [b for b in range(BLOCKS) if b not in dst_blocks]
                assert not t[rest].any()  # blocks not asked for stay as they were

    def times_out(transfer_id: int, what: str) -> None:
        try:
            conn.pull(0, transfer_id, src_blocks, dst_blocks)
        except RuntimeError as e:
            assert "from replica 0" in str(e) and "transfer_timeout_s=1.0" in str(e), e
            assert WIRE in str(e), e
        else:
            raise AssertionError(f"a pull {what} returned")

    zero()
    # the first layer, then the rest (a streamed prompt's last step): rank 1 holds none of
    # the first
    n = conn.pull(0, 5, src_blocks, dst_blocks, (0, 1))
    n += conn.pull(0, 5, src_blocks, dst_blocks, (1, 3))
    assert n == L * 2 * len(src_blocks) * per_block == conn.bytes_moved, n
    landed()
    if PAIRS:  # a pull that timed out with its answer still to come: the pairs start afresh
        times_out(8, "answered late")
        # (both stages' pairs: a pull that fails leaves none with a receive posted)
        assert [conn.pairs.generation(s, rank) for s in (0, 1)] == [1, 1], rank
        assert conn.pairs.retirements == 2
        zero()
        time.sleep(1.0)  # (the late answer has gone out meanwhile)
        assert conn.pull(0, 9, src_blocks, dst_blocks) == n
        landed()
    store.set(f"pulled-{rank}", "1")
    while store.add("closed", 0) < 2:
        time.sleep(0.01)
    t0 = time.monotonic()
    times_out(6, "from a silent replica")
    assert time.monotonic() - t0 < 2.5
    store.set(f"done-{rank}", "1")
assert conn._shares_memory(2 if rank < 2 else 0) == SHM
conn.close()
store.add("finished", 1)
while rank == 0 and store.add("finished", 0) < 4:  # (it hosts the store)
    time.sleep(0.01)
print("ok", rank, flush=True)
os._exit(0)  # the pairs are broken after a timed-out wait: no collective shutdown
'''


@pytest.mark.parametrize(("shm", "wire"), [
    pytest.param(True, "gloo", id="shm", marks=pytest.mark.skipif(
        not supported(), reason="needs x86-64 and /dev/shm")),
    pytest.param(False, "gloo", id="gloo"), pytest.param(False, "gloo_pairs", id="gloo-pairs")])
def test_pieces_cross_ranks_of_two_layouts_layer_by_layer(run_ranks: RunRanks, shm: bool,
                                                          wire: str) -> None:
    token = uuid.uuid4().hex[:12]
    program = RANK_PROGRAM.replace("@SHM@", str(shm)).replace("@TOKEN@", token).replace(
        "@WIRE@", wire)
    try:
        run_ranks(program.replace("@PORT@", str(free_port())), 4, 120.0)
        assert glob.glob(f"{SHM_DIR}/{shm_prefix(token)}*") == []
    finally:  # (what ranks that failed left)
        sweep_run(token)
