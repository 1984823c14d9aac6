"""us per packed linear call at 1, 2, 3 and 5 rows, weights hot (one weight again and
again) and cold (a rotation of ~60 MB of them), one thread: [N, K, M, hot, cold]. Run from
two checkouts (a worktree first on PYTHONPATH), alternating."""

import time

import torch

import meshserve
from meshserve.kernels import native_cpu as nc


def per_call(x: torch.Tensor, weights: list[torch.Tensor], n: int) -> float:
    for w in weights[:5]:
        nc.linear_packed(x, w, n)
    t = time.perf_counter()
    for _ in range(5):
        for w in weights:
            nc.linear_packed(x, w, n)
    return round((time.perf_counter() - t) / (5 * len(weights)) * 1e6, 1)


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for n, k in [(1408, 256), (4096, 96), (4096, 256)]:
        hot = nc.pack(torch.randn(n, k))
        cold = [nc.pack(torch.randn(n, k)) for _ in range(max(4, 60_000_000 // (n * k * 4)))]
        for m in [1, 2, 3, 5]:
            x = torch.randn(m, k)
            rows.append([n, k, m, per_call(x, [hot] * 40, n), per_call(x, cold, n)])
    print(meshserve.__file__.split("/")[2], rows)


if __name__ == "__main__":
    main()
