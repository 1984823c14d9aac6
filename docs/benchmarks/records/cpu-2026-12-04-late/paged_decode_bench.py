import torch, time, sys
from meshserve.kernels import dispatch
torch.set_num_threads(1)
POOL = 256 << 20
def run(batch, ctx, heads, kvh, hd, bs=16, pool=POOL):
    g = torch.Generator().manual_seed(0)
    bps = -(-ctx // bs)
    blk_bytes = bs * kvh * hd * 4
    nb = max(2 * batch * bps, pool // blk_bytes // 2)
    from meshserve.kernels.host_memory import huge_page_empty
    kc = [huge_page_empty((nb, bs, kvh, hd), torch.float32) for _ in range(2)]
    [c.copy_(torch.randn(c.shape, generator=g)) for c in kc]
    # several independent batches cycling through the pool
    sets = []
    perm = torch.randperm(nb, generator=g)
    nsets = max(1, nb // (batch * bps))
    for s in range(min(nsets, 8)):
        tables = perm[s*batch*bps:(s+1)*batch*bps].view(batch, bps).contiguous()
        sets.append(tables)
    lens = torch.full((batch,), ctx, dtype=torch.int64)
    q = torch.randn(batch, heads, hd, generator=g)
    def f():
        for t in sets: dispatch.paged_decode(q, kc[0], kc[1], t, lens, hd ** -0.5)
    f(); best = 1e9
    for _ in range(5):
        t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
    best /= len(sets)
    gbs = 2 * batch * ctx * kvh * hd * 4 / best / 1e9
    print(f"b{batch} ctx{ctx} H{heads} Hkv{kvh} D{hd} sets{len(sets)}: {best*1e6:.0f} us, {gbs:.1f} GB/s, {best*1e9/(batch*ctx):.1f} ns/token")
run(16, 900, 8, 4, 32)
run(64, 256, 8, 4, 32)
run(8, 512, 16, 8, 128)
run(8, 512, 8, 8, 128)
run(8, 512, 32, 8, 128)
run(8, 512, 8, 2, 64)
print("hot")
run(4, 128, 8, 4, 32, pool=0)
run(4, 128, 8, 8, 128, pool=0)
