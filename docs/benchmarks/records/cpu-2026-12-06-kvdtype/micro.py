"""Paged decode attention alone (see README.md, section 3): python micro.py"""
import time

import torch

from meshserve.kernels import native_cpu

torch.set_num_threads(1)
L, nb, bs, hkv, d, h = 8, 1200, 16, 4, 64, 8
B, ctx = 3, 2000
def run(dt, layers):
    caches = [(torch.randn(nb, bs, hkv, d).to(dt), torch.randn(nb, bs, hkv, d).to(dt)) for _ in range(layers)]
    q = torch.randn(B, h, d)
    tables = torch.stack([torch.randperm(nb)[:ctx // bs + 1] for _ in range(B)])
    lens = torch.full((B,), ctx)
    best = 1e9
    for _ in range(30):
        t = time.perf_counter()
        for k, v in caches:
            native_cpu.paged_decode(q, k, v, tables, lens, 0.125)
        best = min(best, time.perf_counter() - t)
    per = best / (layers * B * ctx) * 1e9
    print(dt, "layers", layers, f"{best*1e3:.2f} ms, {per:.1f} ns/token-layer, {B*ctx*layers*2*hkv*d*(4 if dt==torch.float32 else 2)/best/1e9:.1f} GB/s")
for dt in (torch.float32, torch.bfloat16):
    run(dt, 1)   # warm: 3*2000 tokens*2KiB = 12MB fp32 -> maybe L3
    run(dt, 8)
