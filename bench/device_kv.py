"""The device check's KV section: one prompt's KV pulled from a prefill rank's cache into a
decode rank's, two processes, over every wire this machine has.

Each wire runs in a fresh pair of processes with its own store: rank 0 (a prefill replica
of one rank) answers by itself, rank 1 (a decode replica of one rank) pulls random source
blocks into random destination blocks and times each pull, synchronized, from its call to
its last layer in place; it checks the first layer's K and the last layer's V of every
block moved against what it regenerates of the source's cache. The caches are the
check's model's shape in its dtype, on the device: both ranks on GPU 0 when there is one
(gloo then crosses host memory; NIXL goes VRAM to VRAM), ranks on GPUs 0 and 1 for NCCL,
which takes one GPU a rank and is skipped with fewer.
"""

from __future__ import annotations

import queue
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BLOCK = 16
WAIT_S = 90.0


def kv_section(s: Any) -> dict[str, Any]:
    """Every wire's pull medians (ms) and GB/s by prompt length, or why it was skipped."""
    from meshserve.engine.kv_transfer.nixl_agent import nixl_available

    gpus = torch.cuda.device_count() if s.device.type == "cuda" else 0
    wires: dict[str, str | None] = {"torch-gloo": None, "torch-gloo_pairs": None,
                                    "torch-nccl": None, "nixl": None}
    if s.device.type != "cuda":
        wires["torch-nccl"] = "needs GPUs"
    elif gpus < 2:
        wires["torch-nccl"] = f"needs 2 GPUs (NCCL takes one a rank); {gpus} here"
    if not nixl_available():
        wires["nixl"] = "nixl is not installed"
    out: dict[str, Any] = {"tokens": list(s.kv_tokens), "gpus": gpus}
    for wire, skipped in wires.items():
        if skipped is not None:
            out[wire] = {"skipped": skipped}
            continue
        try:
            out[wire] = _run_pair(s, wire, gpus)
        except Exception as e:  # noqa: BLE001 - recorded; the next wire still runs
            out[wire] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _run_pair(s: Any, wire: str, gpus: int) -> dict[str, Any]:
    from meshserve.parallel.comm.discovery import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, wire, gpus, s, results))
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + WAIT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    try:
        found = results.get(timeout=5.0)
    except queue.Empty:
        found = None
    if found is None or [p.exitcode for p in procs] != [0, 0]:
        raise RuntimeError(f"{wire}: ranks exited {[p.exitcode for p in procs]}, "
                           f"reported {found}")
    return found


def _shape(s: Any) -> tuple[int, int, int, int]:
    m = s.model
    head_dim = m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"]
    return m["num_hidden_layers"], BLOCK, m["num_key_value_heads"], head_dim


def _layer(s: Any, device: torch.device, layer: int, which: int,
           num_blocks: int) -> torch.Tensor:
    """The source cache's layer `layer`, K (0) or V (1): the same on every rank that asks."""
    _, bs, heads, dim = _shape(s)
    g = torch.Generator().manual_seed(1000 + 2 * layer + which)  # (on the host: the same
    return torch.randn(num_blocks, bs, heads, dim, generator=g,  # on any GPU)
                       dtype=torch.float32).to(device=device, dtype=s.dtype)


def _rank(rank: int, port: int, wire: str, gpus: int, s: Any, results: Any) -> None:
    from meshserve.engine.kv_transfer.factory import make_connector
    from meshserve.engine.kv_transfer.peers import KVPeers
    from meshserve.engine.kv_transfer.pieces import RankKV

    device = s.device
    if device.type == "cuda":
        device = torch.device("cuda", rank if wire == "torch-nccl" else 0)
        torch.cuda.set_device(device)
    layers, _, heads, _ = _shape(s)
    num_blocks = 2 * max(s.kv_tokens) // BLOCK + 8
    if rank == 0:
        cache = [(_layer(s, device, i, 0, num_blocks), _layer(s, device, i, 1, num_blocks))
                 for i in range(layers)]
    else:
        shape = (num_blocks, *_shape(s)[1:])
        cache = [(torch.zeros(shape, dtype=s.dtype, device=device),
                  torch.zeros(shape, dtype=s.dtype, device=device)) for _ in range(layers)]
    wait = timedelta(seconds=WAIT_S)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=wait)

    def connect() -> dist.Store:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)

    peers = KVPeers(store, [1, 1], connect)
    name, _, how = wire.partition("-")
    conn = make_connector(name, RankKV(rank, (0, layers), (0, heads)), rank, cache, peers,
                          60.0, shm=False, wire=how or "gloo")
    talk = connect()
    if rank == 0:
        talk.wait(["done"], wait)
        conn.close()
        talk.wait(["closed"], wait)  # (this rank hosts the store: the other is done with it)
    else:
        out: dict[str, Any] = {}
        first_k = _layer(s, device, 0, 0, num_blocks)
        last_v = _layer(s, device, layers - 1, 1, num_blocks)
        transfer = 0
        for tokens in s.kv_tokens:
            n = tokens // BLOCK
            times, nbytes = [], 0
            for r in range(s.kv_rounds + 1):  # (the first a warm-up)
                transfer += 1
                perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(r))
                src, dst = perm[:n].tolist(), perm[-n:].tolist()
                t0 = time.perf_counter()
                nbytes = conn.pull(0, transfer, src, dst)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if r:
                    times.append(time.perf_counter() - t0)
                assert torch.equal(cache[0][0][dst], first_k[src]), (wire, tokens, r)
                assert torch.equal(cache[-1][1][dst], last_v[src]), (wire, tokens, r)
            med = statistics.median(times)
            out[f"{tokens}_ms"] = med * 1e3
            out[f"{tokens}_gbs"] = nbytes / med / 1e9
            out[f"{tokens}_mb"] = nbytes / 1e6

        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(-1)).tolist()
        n = s.kv_tokens[0] // BLOCK

        def pull_checked(transfer: int, slot: int,
                         layers: tuple[int, int] | None = None) -> None:
            src, dst = perm[-n:], perm[slot * n:(slot + 1) * n]  # (slots' blocks apart)
            conn.pull(0, transfer, src, dst, layers)
            if layers is None or layers[0] == 0:
                assert torch.equal(cache[0][0][dst], first_k[src]), (wire, "check", slot)
            if layers is None or layers[1] == len(cache):
                assert torch.equal(cache[-1][1][dst], last_v[src]), (wire, "check", slot)

        # a streamed prompt's last step: its first layer, then the rest
        pull_checked(transfer + 1, 0, (0, 1))
        pull_checked(transfer + 2, 0, (1, layers))
        # pulls from two threads at once (each pair's messages in one order)
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(pull_checked, transfer + 3 + i, 1 + i) for i in range(2)]:
                f.result()
        out["checked"] = "timed pulls, a layered pull, two pulls at once"
        results.put(out)
        talk.set("done", "1")
        conn.close()
        talk.set("closed", "1")
