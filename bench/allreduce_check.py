"""gloo vs shared-memory AllReduce latency between two local CPU ranks, one thread each:
`python -m meshserve.bench.allreduce_check` prints one line per message size."""

from __future__ import annotations

import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshserve.parallel.comm.discovery import free_port
from meshserve.parallel.comm.shm_allreduce import ShmAllReduce

SIZES = (512, 2048, 16384, 65536, 262144)
"""float32 elements: 2 KB .. 1 MB."""


def _rank(rank: int, port: int, calls: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    shm = ShmAllReduce(dist.group.WORLD, rank, 2, timeout=timedelta(seconds=60))
    for n in SIZES:
        x = torch.ones(n)
        medians = {}
        calls_of = (("gloo", lambda x=x: dist.all_reduce(x)),
                    ("shm", lambda x=x: shm.all_reduce(x)))
        for name, fn in calls_of:
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            medians[name] = statistics.median(times[calls // 6:])
        if rank == 0:
            print(f"{n * 4:>8d} B  gloo {medians['gloo'] * 1e6:7.1f} us  "
                  f"shm {medians['shm'] * 1e6:6.1f} us  x{medians['gloo'] / medians['shm']:.1f}",
                  flush=True)
    shm.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Spawn the two ranks on a free port."""
    del argv
    mp.spawn(_rank, args=(free_port(), 300), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
