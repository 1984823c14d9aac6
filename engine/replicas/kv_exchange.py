"""A prompt's KV out of one engine and into another: the engine-side half of shipping
KV blocks from a prefill replica to a decode replica.

The exporting engine reads the prompt's full blocks from its prefix cache (a finished
prefill leaves them there); the importing engine pins the full blocks it already caches,
takes fresh blocks for the rest, asks for only those, writes them and caches them, so
the prompt's admission is a prefix hit and computes only its last, partial block. The
two must pass the handshake first. Here both engines hold their whole cache in this
process (one rank each); the ranks of a TP or PP replica move their own pieces
(`engine/kv_transfer/pieces.py`, `engine/kv_transfer/agent.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshserve.engine.core.sequence import Sequence
from meshserve.engine.engine import Engine
from meshserve.engine.kv_transfer.blocks import KVCache, gather_blocks, scatter_blocks
from meshserve.engine.kv_transfer.handshake import KVSpec
from meshserve.engine.worker.worker import Worker

Fetch = Callable[[int], torch.Tensor]
"""fetch(first_block) -> the packed KV of the prompt's full blocks from that index on."""


def driver_worker(engine: Engine) -> Worker:
    """The worker of this process: the engine's only one, or its driver rank's (stage 0,
    TP rank 0) in a multi-rank replica."""
    worker = getattr(engine.executor, "worker", None)
    if not isinstance(worker, Worker) or worker.runner is None:
        raise ValueError(f"moving KV in and out of an engine needs its worker in this "
                         f"process; this one runs {type(engine.executor).__name__}")
    return worker


def kv_cache_of(engine: Engine) -> KVCache:
    """The engine's KV cache, when its replica is one rank (this process's own worker: in
    process, or a launched replica's driver)."""
    par = engine.config.parallel
    if par.tp * par.pp != 1:
        raise ValueError(f"moving a whole KV cache in and out of an engine needs it in this "
                         f"process (one rank); this one has parallel.tp={par.tp}, "
                         f"pp={par.pp}: allowed is tp=pp=1 (a multi-rank replica moves KV "
                         "rank by rank: engine/kv_transfer/agent.py)")
    runner = driver_worker(engine).runner
    assert runner is not None
    return runner.kv_cache


def kv_spec(engine: Engine) -> KVSpec:
    """What the other side of a transfer must match."""
    runner = driver_worker(engine).runner
    assert runner is not None
    k = runner.kv_cache[0][0]
    c = engine.config
    return KVSpec(model=str(engine.model_dir.name), block_size=c.engine.block_size,
                  dtype=str(k.dtype).removeprefix("torch."), num_layers=engine.arch.num_hidden_layers,
                  num_kv_heads=engine.arch.num_key_value_heads, head_dim=engine.arch.head_dim,
                  tp=c.parallel.tp, pp=c.parallel.pp)


def export_prompt_kv(engine: Engine, token_ids: list[int], first_block: int
                     ) -> torch.Tensor | None:
    """The packed KV of `token_ids`' full blocks (all but the last token's) from
    `first_block` on, as this engine's prefix cache holds them; None if it no longer
    holds them all (evicted: the receiver must recompute)."""
    bm = engine.scheduler.block_manager
    blocks = bm.find_cached_prefix(Sequence(-1, list(token_ids), max_tokens=1))
    n_full = (len(token_ids) - 1) // bm.block_size
    if len(blocks) < n_full:
        return None
    return gather_blocks(kv_cache_of(engine), blocks[first_block:])


def import_prompt_kv(engine: Engine, token_ids: list[int], fetch: Fetch) -> int:
    """Bring `token_ids`' KV into this engine's prefix cache; returns the prompt tokens it
    now holds (0 when blocks are short, or the sender no longer has them). Blocks stay
    pinned while `fetch` runs and are freed uncached if it fails."""
    bm = engine.scheduler.block_manager
    imp = bm.begin_import(list(token_ids))
    if imp is None:
        return 0
    written = False
    try:
        if imp.blocks:
            packed = fetch(imp.first_block)
            if packed is None:
                return 0
            scatter_blocks(kv_cache_of(engine), imp.blocks, packed)
        written = True
        return (len(imp.cached) + len(imp.blocks)) * bm.block_size
    finally:
        bm.finish_import(imp, written=written)
