"""Driving a disaggregated engine in tests: step until a condition, kill a replica, check
what moved and that nothing is left held."""

from __future__ import annotations

import glob
import os
import signal
import time
from collections.abc import Callable

from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.disagg.front import DisaggEngine
from meshserve.engine.kv_transfer.peers import shm_prefix
from meshserve.parallel.comm.shm_names import SHM_DIR


def run_until(engine: DisaggEngine, done: Callable[[list[RequestOutput]], bool],
              timeout_s: float = 60.0) -> list[RequestOutput]:
    """Step the front until `done(outputs so far)`; those outputs."""
    outs: list[RequestOutput] = []
    deadline = time.monotonic() + timeout_s
    while not done(outs):
        assert time.monotonic() < deadline, "timed out"
        outs += engine.step()
    return outs


def kill_replica(engine: DisaggEngine, index: int) -> None:
    """SIGKILL replica `index` (one in a process of its own)."""
    victim = engine._remotes[index]
    assert victim.index == index and victim.proc is not None
    os.kill(victim.proc.pid, signal.SIGKILL)


def assert_no_blocks_held(engine: DisaggEngine, within_s: float = 10.0) -> None:
    """Every side back to baseline (a sender's last transfer may end just after its
    request did): nothing pinned, leased or importing."""
    deadline = time.monotonic() + within_s
    while True:
        engine.reset_prefix_cache()  # fresh counters from every replica (each idle after it)
        used = {s.index: s.stats.num_used_blocks for s in engine.replica_states() if s.up}
        if not any(used.values()):
            break
        assert time.monotonic() < deadline, f"blocks still used, by replica: {used}"
        time.sleep(0.05)
    assert engine._engine0 is not None
    engine._engine0.scheduler.block_manager.check_invariants()  # (its thread waits)


def assert_each_block_moved_once(engine: DisaggEngine, prompts: list[list[int]],
                                 block_bytes: int, min_tokens: int = 16,
                                 block_size: int = 8) -> list[list[int]]:
    """Every prompt of at least `min_tokens` hopped, none failed, and each moved every
    block of its KV once, its partial last one too; the prompts that hopped."""
    hopped = [p for p in prompts if len(p) >= min_tokens]
    t = engine.transfers
    assert t.num_transfers == len(hopped) and t.num_failed == 0
    assert t.bytes == sum(-(-len(p) // block_size) for p in hopped) * block_bytes
    return hopped


def shm_files(run: str) -> list[str]:
    """What KV world `run` (`DisaggEngine.kv_run`) has in shared memory now: the files'
    names after the run's prefix."""
    prefix = f"{SHM_DIR}/{shm_prefix(run)}"
    return sorted(p[len(prefix):] for p in glob.glob(f"{prefix}*"))
