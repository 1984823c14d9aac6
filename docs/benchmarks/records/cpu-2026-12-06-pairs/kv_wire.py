"""Time the torch connector's pull between two processes on this host over each wire:
`gloo` (one tagged group) and `gloo_pairs` (a group per pair of ranks, messages in one
order), shared memory off.

Two ranks (a prefill replica and a decode replica of one rank each), caches of the
bench's `tiny` model (8 layers, 4 KV heads of 64, fp32, 16-token blocks). Each round the
decode rank pulls a prompt's blocks from random source blocks into random destination
blocks (apart from the other pulls'), `--concurrent` pulls at once (threads, as the decode replica's transfers run),
timed from a barrier to the last pull's return, and checks layer 0's K; the prefill
rank's connector answers by itself.

    python kv_wire.py --wire gloo_pairs --tokens 1000 2000 --rounds 30 --concurrent 1
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, HEADS, DIM, BS, NUM_BLOCKS = 8, 4, 64, 16, 1024


def rank_main(rank: int, store_path: str, port: int, args: argparse.Namespace,
              q) -> None:  # noqa: ANN001
    from meshserve.engine.kv_connector import KVPeers, make_connector
    from meshserve.engine.worker.kv_pieces import RankKV

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    cache = [(torch.randn(NUM_BLOCKS, BS, HEADS, DIM, generator=gen),
              torch.randn(NUM_BLOCKS, BS, HEADS, DIM, generator=gen)) for _ in range(LAYERS)]
    wait = __import__("datetime").timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=wait)

    def connect() -> dist.Store:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)

    peers = KVPeers(store, [1, 1], connect)
    # (a commit from before the wires were named has only gloo's)
    named = "wire" in inspect.signature(make_connector).parameters
    assert named or args.wire == "gloo", "this commit has only the gloo wire"
    conn = make_connector("torch", RankKV(rank, (0, LAYERS), (0, HEADS)), rank, cache, peers,
                          60.0, shm=False, **({"wire": args.wire} if named else {}))
    sync = dist.ProcessGroupGloo(dist.PrefixStore("sync", dist.FileStore(store_path, 2)),
                                 rank, 2)
    want = torch.randn(NUM_BLOCKS, BS, HEADS, DIM, generator=torch.Generator().manual_seed(0))
    tid = 0
    with ThreadPoolExecutor(args.concurrent) as pool:
        for n in args.tokens:
            times = []
            for _ in range(args.rounds):
                moves = []
                dst = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(-tid))
                for i in range(args.concurrent):  # (the pulls' destinations apart)
                    tid += 1
                    src = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(tid))
                    nb = n // BS
                    moves.append((tid, src[:nb].tolist(), dst[i * nb:(i + 1) * nb].tolist()))
                sync.barrier().wait()
                if rank == 1:
                    t0 = time.perf_counter()
                    futures = [pool.submit(conn.pull, 0, t, s, d) for t, s, d in moves]
                    for f in futures:
                        f.result()
                    times.append(time.perf_counter() - t0)
                    for _, s, d in moves:
                        assert torch.equal(cache[0][0][d], want[s])  # layer 0's K, from rank 0
                sync.barrier().wait()
            if rank == 1:
                q.put((n, statistics.median(times), min(times),
                       args.concurrent * (n // BS) * BS * 16384))
    sync.barrier().wait()
    conn.close()
    sync.barrier().wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wire", default="gloo", choices=["gloo", "gloo_pairs"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 2000])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--concurrent", type=int, default=1)
    args = ap.parse_args()
    import meshserve
    from meshserve.parallel.comm.discovery import free_port

    print(f"# package: {os.path.dirname(meshserve.__file__)}, wire={args.wire}, "
          f"concurrent={args.concurrent}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, f"{d}/store", port, args, q))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    print("| tokens | MB moved | pull median (ms) | min (ms) | GB/s (median) |")
    print("|---|---|---|---|---|")
    while not q.empty():
        n, med, low, nbytes = q.get()
        print(f"| {n} | {nbytes / 1e6:.1f} | {med * 1e3:.1f} | {low * 1e3:.1f} | "
              f"{nbytes / med / 1e9:.2f} |")


if __name__ == "__main__":
    main()
