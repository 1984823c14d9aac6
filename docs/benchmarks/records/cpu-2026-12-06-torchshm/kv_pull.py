"""Time the torch connector moving one prompt's KV between two processes on this host,
through shared memory or through gloo.

Two ranks (a prefill replica and a decode replica of one rank each), caches of the
bench's `tiny` model (8 layers, 4 KV heads of 64, fp32, 16-token blocks). Each round
moves a prompt's blocks from random source blocks into random destination blocks; the
decode rank times its pull from a barrier to the last block placed, and checks the
blocks. (The records of 2026-12-05 hold the gloo-only version of this script.)

    python kv_pull.py --tokens 1000 2000 --rounds 15 --shm true
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, HEADS, DIM, BS, NUM_BLOCKS = 8, 4, 64, 16, 1024


def rank_main(rank: int, store_path: str, tokens: list[int], rounds: int, shm: bool,
              q) -> None:  # noqa: ANN001
    from meshserve.engine.kv_connector import RUN_KEY, KVPeers, make_connector
    from meshserve.engine.worker.kv_pieces import RankKV

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    cache = [(torch.randn(NUM_BLOCKS, BS, HEADS, DIM, generator=gen),
              torch.randn(NUM_BLOCKS, BS, HEADS, DIM, generator=gen)) for _ in range(LAYERS)]
    store = dist.FileStore(store_path, 2)
    peers = KVPeers(store, [1, 1])
    if rank == 0:
        store.set(RUN_KEY, f"bench{os.getppid()}")
    conn = make_connector("torch", RankKV(rank, (0, LAYERS), (0, HEADS)), rank, cache, peers,
                          60.0, shm=shm)
    assert conn._shares_memory(1 - rank) == shm
    sync = dist.ProcessGroupGloo(dist.PrefixStore("sync", store), rank, 2)
    tid = 0
    for n in tokens:
        times = []
        for _ in range(rounds):
            tid += 1
            blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(tid))
            src, dst = blocks[:n // BS].tolist(), blocks[-(n // BS):].tolist()
            sync.barrier().wait()
            t0 = time.perf_counter()
            if rank == 0:
                conn.send(1, tid, src)
            else:
                conn.pull(0, tid, src, dst)
                times.append(time.perf_counter() - t0)
                want = torch.randn(NUM_BLOCKS, BS, HEADS, DIM,
                                   generator=torch.Generator().manual_seed(0))
                assert torch.equal(cache[0][0][dst], want[src])  # layer 0's K, from rank 0
        if rank == 1:
            q.put((n, statistics.median(times), min(times), n // BS * BS * 16384))
    sync.barrier().wait()
    conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 2000])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shm", default="true", choices=["true", "false"])
    args = ap.parse_args()
    import meshserve

    print(f"# package: {os.path.dirname(meshserve.__file__)}, shm={args.shm}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=rank_main, args=(r, f"{d}/store", args.tokens,
                                                     args.rounds, args.shm == "true", q)) for r in range(2)]
        for p in procs:
            p.start()
        for _ in args.tokens:
            n, med, best, nbytes = q.get(timeout=600)
            print(f"tokens={n} bytes={nbytes} pull_median_ms={med * 1e3:.2f} "
                  f"pull_min_ms={best * 1e3:.2f} GB/s={nbytes / med / 1e9:.2f}", flush=True)
        for p in procs:
            p.join(60)
    sys.exit(0)


if __name__ == "__main__":
    main()
