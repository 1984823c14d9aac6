"""What one 33 MB file in shared memory costs, step by step: made (its pages reserved or
not), mapped (with MAP_POPULATE or not), written through the mapping, mapped again as a
receiver would, read into a tensor, unmapped and removed. One process, median of 10 per
variant, against a copy between two warm tensors of the same size.

    python page_cost.py
"""

import mmap
import os
import time

import torch

N = 32768000
PATH = "/dev/shm/meshserve-costtest"
src = torch.randn(N // 4)
dst = torch.empty(N // 4)


def one(populate: bool, falloc: bool) -> list[float]:
    t0 = time.perf_counter()
    fd = os.open(PATH, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    if falloc:
        os.posix_fallocate(fd, 0, N)
    else:
        os.ftruncate(fd, N)
    t1 = time.perf_counter()
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    buf = mmap.mmap(fd, N, flags=flags)
    t2 = time.perf_counter()
    v = torch.frombuffer(buf, dtype=torch.float32)
    v.copy_(src)
    t3 = time.perf_counter()
    fd2 = os.open(PATH, os.O_RDWR)
    buf2 = mmap.mmap(fd2, N, flags=flags)
    os.unlink(PATH)
    os.close(fd)
    os.close(fd2)
    v2 = torch.frombuffer(buf2, dtype=torch.float32)
    t4 = time.perf_counter()
    dst.copy_(v2)
    t5 = time.perf_counter()
    del v, v2
    buf.close()
    buf2.close()
    t6 = time.perf_counter()
    marks = [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6), (t0, t6)]
    return [round((b - a) * 1e3, 2) for a, b in marks]


torch.set_num_threads(1)
for populate in (False, True):
    for falloc in (True, False):
        rs = [one(populate, falloc) for _ in range(10)]
        med = [sorted(x)[5] for x in zip(*rs, strict=True)]
        print(f"populate={populate} fallocate={falloc}: create {med[0]} map {med[1]} "
              f"write {med[2]} map2 {med[3]} read {med[4]} close {med[5]} total {med[6]} ms")
t0 = time.perf_counter()
for _ in range(10):
    dst.copy_(src)
print("plain copy", round((time.perf_counter() - t0) / 10 * 1e3, 2), "ms")
