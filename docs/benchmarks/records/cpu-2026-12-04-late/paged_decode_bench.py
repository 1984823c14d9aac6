"""Times kernels.dispatch.paged_decode per cached token and layer, one thread, over caches
on huge pages larger than the last-level cache (several batches' tables take turns)."""

import time

import torch

from meshserve.kernels import dispatch
from meshserve.kernels.host_memory import huge_page_empty

POOL = 256 << 20


def run(batch: int, ctx: int, heads: int, kvh: int, hd: int, bs: int = 16,
        pool: int = POOL) -> None:
    g = torch.Generator().manual_seed(0)
    bps = -(-ctx // bs)
    nb = max(2 * batch * bps, pool // (bs * kvh * hd * 4) // 2)
    kc = [huge_page_empty((nb, bs, kvh, hd), torch.float32) for _ in range(2)]
    for c in kc:
        c.copy_(torch.randn(c.shape, generator=g))
    perm = torch.randperm(nb, generator=g)
    sets = [perm[s * batch * bps:(s + 1) * batch * bps].view(batch, bps).contiguous()
            for s in range(min(8, max(1, nb // (batch * bps))))]
    lens = torch.full((batch,), ctx, dtype=torch.int64)
    q = torch.randn(batch, heads, hd, generator=g)

    def f() -> None:
        for t in sets:
            dispatch.paged_decode(q, kc[0], kc[1], t, lens, hd ** -0.5)

    f()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    best /= len(sets)
    gbs = 2 * batch * ctx * kvh * hd * 4 / best / 1e9
    print(f"b{batch} ctx{ctx} H{heads} Hkv{kvh} D{hd}: {best * 1e6:.0f} us, {gbs:.1f} GB/s, "
          f"{best * 1e9 / (batch * ctx):.1f} ns/token")


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(16, 900, 8, 4, 32)
    run(64, 256, 8, 4, 32)
    run(8, 512, 16, 8, 128)
    run(8, 512, 8, 8, 128)
    run(8, 512, 32, 8, 128)
    run(8, 512, 8, 2, 64)
