"""Measure this machine for the cost model: matmul rate, memory bandwidth (alone and with
every rank reading at once), AllReduce and p2p times per group size; write a cluster preset.

Collectives run in spawned ranks (gloo on CPU, NCCL on GPUs) meeting on a free 127.0.0.1
port. Times over several message sizes are fitted to t = a + b·S, then read through the
cost model's own formulas: AllReduce a = 2(n-1)·α, b = 2(n-1)/n / B; p2p a = α, b = 1 / B.
"""

from __future__ import annotations

import json
import queue
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch

from meshserve.parallel.comm.discovery import free_port
from meshserve.parallel.comm.mesh import ACTIVATION_SLOT_BYTES
from meshserve.parallel.comm.shm_allreduce import ShmAllReduce
from meshserve.parallel.comm.shm_allreduce import supported as shm_supported
from meshserve.parallel.comm.shm_ring import RingKey, ShmRing, connect_rings
from meshserve.parallel.planner.cluster import ClusterConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs, both clipped at >= 0."""
    assert len(xs) == len(ys) >= 2, (xs, ys)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
    return max(0.0, my - slope * mx), slope


def _bound_slope(sizes: Sequence[float], times: Sequence[float]) -> float:
    """Seconds per byte when the fit finds none (noise, or messages too small to show
    bandwidth): the largest message's time bounds it, so the preset stays finite."""
    i = max(range(len(sizes)), key=lambda j: sizes[j])
    return max(times[i], 1e-9) / max(sizes[i], 1.0)


def allreduce_link(world: int, intercept_s: float, slope_s_per_byte: float) -> tuple[float, float]:
    """(latency per ring step s, bandwidth bytes/s) from an AllReduce fit over `world` ranks."""
    assert world >= 2
    latency = intercept_s / (2 * (world - 1))
    bandwidth = 2 * (world - 1) / world / slope_s_per_byte if slope_s_per_byte else float("inf")
    return latency, bandwidth


def sig(x: float, digits: int = 4) -> float:
    """`x` rounded to `digits` significant digits."""
    return float(f"{x:.{digits}g}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The fastest of `repeats` timed calls after one warm-up."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_tflops(n: int, dtype: str, device: torch.device, repeats: int) -> float:
    """Dense n x n x n matmul rate, TFLOP/s."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device, DTYPES[dtype])
    b = torch.randn(n, n, generator=gen).to(device, DTYPES[dtype])
    return 2 * n**3 / best_time(lambda: a @ b, repeats, device) / 1e12


MATMUL_ROWS = (4, 8, 16, 32, 64)
"""Row counts (tokens) at which calibrate times a weight matmul against the square rate
(one row is a matter of memory bandwidth, which the roofline prices on its own)."""

WEIGHTS_BYTES = 64 << 20
"""The weights the half-rows matmuls cycle through: more than a last-level cache holds, as
in a forward pass, which reads each weight once. One weight timed over and over stays in
cache and runs small batches up to twice as fast as the model ever sees."""


def cold_matmul_tflops(shapes: Sequence[tuple[int, int]], dtype: str, device: torch.device,
                       repeats: int, rows: Sequence[int],
                       weights_bytes: int = WEIGHTS_BYTES) -> list[float]:
    """TFLOP/s of x [M, k] @ w [k, n] over the (k, n) weight `shapes` in turn, cycled
    through `weights_bytes` of weights (so none is in cache), for each M in `rows`. The
    weights are laid out and multiplied as the runtime does (models.loader, dispatch.linear:
    on the CPU packed for the C kernel where it runs, else wide ones column-major)."""
    from meshserve.kernels import dispatch
    from meshserve.models.loader import column_major_wide_weights, pack_linear_weights

    torch_dtype = getattr(torch, dtype)
    per_round = sum(k * n for k, n in shapes) * torch_dtype.itemsize
    ws = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(n, k, device=device, dtype=torch_dtype),
                           requires_grad=False)
        for _ in range(max(1, -(-weights_bytes // per_round))) for k, n in shapes)
    flops_per_row = 2 * sum(w.shape[0] * w.shape[1] for w in ws)
    if device.type == "cpu":
        holder = torch.nn.ModuleList(_Weight(w) for w in ws)
        if not pack_linear_weights(holder):
            column_major_wide_weights(holder)
        ws = torch.nn.ParameterList(m.weight for m in holder)
    rates = []
    for m in rows:
        xs = {k: torch.randn(m, k, device=device, dtype=torch_dtype) for k, _ in shapes}
        t = best_time(lambda xs=xs: [dispatch.linear(xs[w.shape[1]], w) for w in ws],
                      repeats, device)
        rates.append(m * flops_per_row / t / 1e12)
    return rates


class _Weight(torch.nn.Module):
    """A bare module holding one weight (for the loader's layout pass)."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


def matmul_half_rows(width: int, dtype: str, device: torch.device, repeats: int,
                     peak_tflops: float, weights_bytes: int = WEIGHTS_BYTES) -> float:
    """The M at which cache-cold weight matmuls (cold_matmul_tflops) run at half
    `peak_tflops`: the median over MATMUL_ROWS of M x (peak / rate(M) - 1), 0 at peak."""
    rates = cold_matmul_tflops([(width, 4 * width)], dtype, device, repeats, MATMUL_ROWS,
                               weights_bytes)
    estimates = sorted(max(0.0, m * (peak_tflops / r - 1)) for m, r in zip(MATMUL_ROWS, rates))
    return estimates[len(estimates) // 2]


EFFICIENCY_ROWS = tuple(2 ** i for i in range(9))
"""Rows at which calibrate measures weight matmuls: 1, 2, 4, ..., 256."""
EFFICIENCY_SHAPES = ((512, 1024), (512, 512), (512, 2816), (1408, 512))
"""A decoder layer's projections at width 512 (fused QKV with half as many KV heads, out,
merged gate/up, down; 11.8 MB in fp32): what decode steps of a small model multiply."""


def matmul_efficiency(dtype: str, device: torch.device, repeats: int, peak_tflops: float,
                      shapes: Sequence[tuple[int, int]] = EFFICIENCY_SHAPES) -> list[float]:
    """Share of `peak_tflops` that cache-cold layer matmuls reach at EFFICIENCY_ROWS rows."""
    rates = cold_matmul_tflops(shapes, dtype, device, repeats, EFFICIENCY_ROWS)
    return [min(1.0, r / peak_tflops) for r in rates]


def read_gbs(nbytes: int, device: torch.device, repeats: int) -> float:
    """GB/s reading an fp32 tensor of `nbytes` (its sum)."""
    x = torch.ones(nbytes // 4, device=device)
    return x.numel() * 4 / best_time(lambda: x.sum(), repeats, device) / 1e9


def gemv_gbs(nbytes: int, device: torch.device, repeats: int) -> float:
    """GB/s of a vector-matrix product over an fp32 matrix of `nbytes`: how decode reads."""
    cols = 4096
    w = torch.ones(max(1, nbytes // 4 // cols), cols, device=device)
    v = torch.ones(1, w.shape[0], device=device)
    return w.numel() * 4 / best_time(lambda: v @ w, repeats, device) / 1e9


KV_SHAPES = ((4, 32), (4, 64), (4, 128), (8, 128))
"""(KV heads, head dim) at which calibrate times paged decode attention, with twice as many
query heads: rows (K and V, fp32) of 1, 2, 4 and 8 KiB. A row's time is not a straight
line in its bytes (on this project's CPUs the middle sizes lie above the line through the
ends), so the fit runs through all four, not through the ends alone."""
KV_POOL_BYTES = 128 << 20
"""Each cache's size when timing attention: more than a last-level cache holds, as a served
batch's KV is; several batches' block tables take turns over it."""


def kv_row_seconds(device: torch.device, repeats: int, kv_heads: int, head_dim: int,
                   batch: int = 8, context: int = 512, block_size: int = 16,
                   pool_bytes: int = KV_POOL_BYTES) -> float:
    """Seconds per cached token (one layer) of the runtime's paged decode attention
    (`kernels.dispatch`): `batch` sequences of `context` tokens in blocks scattered over
    caches of `pool_bytes` (on huge pages on the CPU, as the engine allocates them)."""
    from meshserve.kernels import dispatch
    from meshserve.kernels.host_memory import huge_page_empty

    gen = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_seq = context // block_size
    block_bytes = block_size * kv_heads * head_dim * 4
    num_blocks = max(2 * batch * blocks_per_seq, pool_bytes // block_bytes)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = [huge_page_empty(shape, torch.float32) if device.type == "cpu"
             else torch.empty(shape, device=device) for _ in range(2)]
    for c in cache:
        c.normal_(generator=None)
    order = torch.randperm(num_blocks, generator=gen)
    per_batch = batch * blocks_per_seq
    tables = [order[i * per_batch:(i + 1) * per_batch].view(batch, blocks_per_seq).to(device)
              for i in range(min(8, num_blocks // per_batch))]
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, 2 * kv_heads, head_dim, generator=gen).to(device)

    def run() -> None:
        for t in tables:
            dispatch.paged_decode(q, cache[0], cache[1], t, lens, head_dim ** -0.5)

    return best_time(run, repeats, device) / (len(tables) * batch * context)


def kv_read_fit(device: torch.device, repeats: int) -> tuple[float, float]:
    """(GB/s, ns per row) of paged decode attention: per cached token and layer it takes a
    fixed time plus its K and V bytes at a rate, least-squares fitted over KV_SHAPES."""
    sizes = [2 * kv_heads * head_dim * 4 for kv_heads, head_dim in KV_SHAPES]
    times = [kv_row_seconds(device, repeats, *shape) for shape in KV_SHAPES]
    row_s, per_byte = fit_line(sizes, times)
    if not per_byte:  # noise: the larger rows bound the rate, with no fixed part
        return sizes[-1] / times[-1] / 1e9, 0.0
    return 1 / per_byte / 1e9, row_s * 1e9


def attention_efficiency(device: torch.device, repeats: int, peak_tflops: float,
                         chunk: int = 512, cached: int = 512, kv_heads: int = 8,
                         head_dim: int = 64, block_size: int = 16) -> float:
    """Share of `peak_tflops` (float32) the CPU runtime's prefill attention reaches: a
    `chunk`-token chunk after `cached` tokens, its earlier K/V read through a block table
    (`kernels.paged_attention.paged_prefill`), FLOPs counted over the causal pairs only."""
    from meshserve.kernels import paged_attention

    gen = torch.Generator(device="cpu").manual_seed(0)
    total = cached + chunk
    num_blocks = -(-total // block_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(device) for _ in range(2))
    table = torch.randperm(num_blocks, generator=gen).to(device)
    q = torch.randn(chunk, 2 * kv_heads, head_dim, generator=gen).to(device)
    t = best_time(lambda: paged_attention.paged_prefill(q, k_cache, v_cache, table, cached,
                                                        head_dim ** -0.5), repeats, device)
    pairs = chunk * cached + chunk * (chunk + 1) / 2
    return min(1.0, 4 * 2 * kv_heads * head_dim * pairs / t / (peak_tflops * 1e12))


def layer_overhead_us(device: torch.device, repeats: int) -> float:
    """Fixed cost of one decoder layer's ~20 ops at a width where the math is free: the
    dispatch and launch time a real layer pays on top of its roofline, µs."""
    d, heads, tokens = 64, 4, 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = {k: torch.randn(*shape, generator=gen).to(device) for k, shape in {
        "qkv": (d, 3 * d), "o": (d, d), "gate_up": (d, 4 * d), "down": (2 * d, d),
        "norm": (d,), "cos": (tokens, d // heads), "sin": (tokens, d // heads)}.items()}
    x = torch.randn(tokens, d, generator=gen).to(device)

    def norm(h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w["norm"]

    def rotate(t: torch.Tensor) -> torch.Tensor:  # [H, T, Dh]
        a, b = t.chunk(2, dim=-1)
        return t * w["cos"] + torch.cat((-b, a), dim=-1) * w["sin"]

    def layer() -> torch.Tensor:
        q, k, v = (norm(x) @ w["qkv"]).view(tokens, 3, heads, d // heads).permute(1, 2, 0, 3)
        attn = torch.nn.functional.scaled_dot_product_attention(rotate(q), rotate(k), v)
        h = x + attn.transpose(0, 1).reshape(tokens, d) @ w["o"]
        gate, up = (norm(h) @ w["gate_up"]).chunk(2, dim=-1)
        return h + (torch.nn.functional.silu(gate) * up) @ w["down"]

    with torch.inference_mode():
        return best_time(layer, max(repeats, 20), device) * 1e6


@dataclass(frozen=True, kw_only=True)
class CollectiveTimes:
    """Seconds per message size for one group size."""

    world: int
    """Ranks in the group."""
    sizes: list[int]
    """Message bytes."""
    allreduce_s: list[float]
    """AllReduce of each size (median over repeats, slowest rank)."""
    p2p_s: list[float] = field(default_factory=list)
    """One-way send of each size between ranks 0 and 1 (half a ping-pong)."""
    concurrent_gemv_gbs: float = 0.0
    """Read bandwidth of each rank while all ranks read at once."""


def _rank_main(rank: int, world: int, port: int, sizes: list[int], repeats: int,
               read_bytes: int, use_cuda: bool, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    # The runtime's path: shared memory for CPU ranks on one host (what TP uses), else gloo.
    shm = (ShmAllReduce(dist.group.WORLD, rank, world, timeout=timedelta(seconds=120))
           if not use_cuda and shm_supported() else None)
    # Likewise pipeline hand-offs: shared-memory rings where they fit (ProcessGroups.build).
    rings = (connect_rings([(key, 2, ACTIVATION_SLOT_BYTES)
                            for key in (("act", 0, 1), ("act", 1, 0))], rank, timeout_s=120.0)
             if world == 2 and not use_cuda and shm_supported() else {})
    try:
        dist.barrier()
        gemv = gemv_gbs(read_bytes, device, repeats)  # every rank at once: shared bandwidth
        allreduce, p2p = [], []
        for size in sizes:
            x = torch.ones(max(1, size // 4), device=device)
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if shm is not None and shm.fits(x):
                    shm.all_reduce(x)
                else:
                    dist.all_reduce(x)
                _sync(device)
                times.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(times[1:])], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time counts
            allreduce.append(float(t.cpu()))
            p2p.append(_ping_pong(rank, x, repeats, device, rings) if world == 2 else 0.0)
        if rank == 0:
            out.put(CollectiveTimes(world=world, sizes=sizes, allreduce_s=allreduce,
                                    p2p_s=p2p if world == 2 else [], concurrent_gemv_gbs=gemv))
    finally:
        if shm is not None:
            shm.close()
        for ring in rings.values():
            ring.close()
        dist.destroy_process_group()


def _ping_pong(rank: int, x: torch.Tensor, repeats: int, device: torch.device,
               rings: dict[RingKey, ShmRing]) -> float:
    """One-way time of `x` between ranks 0 and 1, over the rings when it fits them."""
    import torch.distributed as dist

    peer = 1 - rank
    out, back = rings.get(("act", rank, peer)), rings.get(("act", peer, rank))
    ring = out is not None and back is not None and x.numel() * x.element_size() <= \
        out.slot_bytes

    def send() -> None:
        if ring:
            assert out is not None
            out.put([x])
        else:
            dist.send(x, peer)

    def recv() -> None:
        if ring:
            assert back is not None
            back.take_into(x)
        else:
            dist.recv(x, peer)

    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            send()
            recv()
        else:
            recv()
            send()
        _sync(device)
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times[1:])


def measure_collectives(world: int, sizes: list[int], repeats: int, read_bytes: int,
                        use_cuda: bool = False, timeout_s: float = 300.0) -> CollectiveTimes:
    """AllReduce (and p2p at world 2) times with `world` spawned ranks on this machine."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main,
                         args=(r, world, port, sizes, repeats, read_bytes, use_cuda, out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return out.get(timeout=1.0)
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"calibration with {world} ranks failed (exit codes "
                                       f"{failed}, or no result in {timeout_s:g} s)") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Everything measured, in the units of ClusterConfig."""

    device_type: str
    """cpu or cuda."""
    tflops: dict[str, float]
    """Matmul TFLOP/s per dtype (one rank alone)."""
    read_gbs: float
    """Reading a large tensor (sum), one rank alone."""
    gemv_gbs: float
    """Vector-matrix product (decode's access pattern), one rank alone."""
    half_rows: float = 0.0
    """Rows at which a float32 weight matmul reaches half the square rate."""
    efficiency: list[float] = field(default_factory=list)
    """Share of the float32 peak at EFFICIENCY_ROWS rows (weights not in cache)."""
    kv_read_gbs: float = 0.0
    """K/V bytes per second read by paged decode attention (0: not measured)."""
    kv_row_ns: float = 0.0
    """Its fixed time per cached token and layer besides the bytes."""
    attention_efficiency: float = 0.0
    """Share of the float32 peak prefill attention reaches (0: not measured)."""
    layer_overhead_us: float
    """Fixed time of a stand-in decoder layer at negligible width."""
    collectives: list[CollectiveTimes]
    """Per group size."""

    def links(self) -> dict[str, tuple[float, float]]:
        """'allreduce-<n>' / 'p2p': (latency µs, bandwidth GB/s) fitted from the times."""
        fits: dict[str, tuple[float, float]] = {}
        for c in self.collectives:
            a, b = fit_line(c.sizes, c.allreduce_s)
            lat, bw = allreduce_link(c.world, a, b or _bound_slope(c.sizes, c.allreduce_s))
            fits[f"allreduce-{c.world}"] = (lat * 1e6, bw / 1e9)
            if c.p2p_s:
                a, b = fit_line(c.sizes, c.p2p_s)
                fits["p2p"] = (a * 1e6, 1 / (b or _bound_slope(c.sizes, c.p2p_s)) / 1e9)
        return fits

    def to_cluster(self, base: ClusterConfig, name: str) -> ClusterConfig:
        """`base` with the measured figures in place (one node: inter = intra). Without
        collective measurements the links and the node's shared bandwidth stay `base`'s."""
        measured = replace(
            base, name=name, source="calibrated", memory_bandwidth_gbs=sig(self.gemv_gbs),
            peak_tflops_fp32=sig(self.tflops["float32"]),
            peak_tflops_bf16=sig(self.tflops.get("bfloat16", self.tflops["float32"])),
            layer_overhead_us=sig(self.layer_overhead_us, 3),
            matmul_half_rows=sig(self.half_rows, 3),
            matmul_efficiency=[sig(e, 3) for e in self.efficiency],
            kv_read_fraction=(sig(min(1.0, self.kv_read_gbs / self.gemv_gbs), 3)
                              if self.kv_read_gbs else base.kv_read_fraction),
            kv_row_overhead_ns=(sig(self.kv_row_ns, 3) if self.kv_read_gbs
                                else base.kv_row_overhead_ns),
            attention_efficiency=(sig(self.attention_efficiency, 3)
                                  if self.attention_efficiency else base.attention_efficiency))
        if not self.collectives:
            return measured
        widest = max(self.collectives, key=lambda c: c.world)
        lat_us, bw_gbs = self.links()[f"allreduce-{widest.world}"]
        node_bw = widest.concurrent_gemv_gbs * widest.world
        return replace(
            measured,
            node_memory_bandwidth_gbs=sig(node_bw) if self.device_type == "cpu" else None,
            intra_node_bandwidth_gbs=sig(bw_gbs), intra_node_latency_us=sig(lat_us),
            inter_node_bandwidth_gbs=sig(bw_gbs), inter_node_latency_us=sig(lat_us))


def calibrate(*, world_sizes: list[int], sizes: list[int], read_bytes: int, matmul_size: int,
              repeats: int, device: torch.device) -> Calibration:
    """Run every measurement (a few seconds to a minute on CPU)."""
    torch.set_num_threads(1)
    tflops = {dt: matmul_tflops(matmul_size, dt, device, repeats) for dt in DTYPES}
    use_cuda = device.type == "cuda"
    kv_gbs, kv_row_ns = kv_read_fit(device, repeats)
    return Calibration(
        device_type=device.type, tflops=tflops, read_gbs=read_gbs(read_bytes, device, repeats),
        gemv_gbs=gemv_gbs(read_bytes, device, repeats),
        layer_overhead_us=layer_overhead_us(device, repeats),
        half_rows=matmul_half_rows(matmul_size, "float32", device, repeats, tflops["float32"]),
        efficiency=matmul_efficiency("float32", device, repeats, tflops["float32"]),
        kv_read_gbs=kv_gbs, kv_row_ns=kv_row_ns,
        attention_efficiency=(attention_efficiency(device, repeats, tflops["float32"])
                              if device.type == "cpu" else 0.0),
        collectives=[measure_collectives(w, sizes, repeats, read_bytes, use_cuda)
                     for w in world_sizes])


def preset_yaml(cluster: ClusterConfig, cal: Calibration, notes_after: Sequence[str] = ()) -> str:
    """A conf/cluster preset holding `cluster`, with the raw measurements as comments."""
    notes = [f"# Written by `meshserve calibrate` on {time.strftime('%Y-%m-%d %H:%M')}.",
             "# matmul TFLOP/s: " + ", ".join(f"{k} {v:.4g}" for k, v in cal.tflops.items()),
             f"# memory GB/s, one rank: sum {cal.read_gbs:.1f}, vector-matrix {cal.gemv_gbs:.1f}",
             f"# stand-in decoder layer at width 64: {cal.layer_overhead_us:.1f} us",
             f"# float32 weight matmul (weights not in cache) reaches half the square rate at "
             f"{cal.half_rows:.3g} rows",
             "# float32 width-512 layer matmuls (weights not in cache): share of peak at M = "
             + ", ".join(f"{m}: {e:.2f}" for m, e in zip(EFFICIENCY_ROWS, cal.efficiency)),
             f"# paged decode attention (caches not in cache) reads K/V at "
             f"{cal.kv_read_gbs:.3g} GB/s, plus {cal.kv_row_ns:.3g} ns per cached token and "
             "layer",
             f"# prefill attention (512 tokens after 512): {cal.attention_efficiency:.2f} of the "
             "float32 peak" if cal.attention_efficiency else
             "# prefill attention: not measured (the base preset's efficiency kept)"]
    for c in cal.collectives:
        notes.append(f"# {c.world} ranks: vector-matrix {c.concurrent_gemv_gbs:.1f} GB/s each; "
                     "AllReduce " + ", ".join(f"{s}B {t * 1e6:.0f}us"
                                              for s, t in zip(c.sizes, c.allreduce_s)))
        if c.p2p_s:
            notes.append("#   p2p " + ", ".join(f"{s}B {t * 1e6:.0f}us"
                                                 for s, t in zip(c.sizes, c.p2p_s)))
    notes += [f"# fit {k}: latency {lat:.1f} us, bandwidth {bw:.3g} GB/s"
              for k, (lat, bw) in cal.links().items()]
    notes.append("# One node measured: inter-node figures repeat the intra-node ones."
                 if cal.collectives else "# No collectives measured: links are the base preset's.")
    notes += [f"# {n}" for n in notes_after]
    body = ["defaults:", "  - cluster_schema"]
    body += [f"{f}: {json.dumps(getattr(cluster, f))}" for f in cluster.__dataclass_fields__]
    return "\n".join(notes + body) + "\n"
