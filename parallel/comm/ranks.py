"""Where this process stands among the ranks of a run, and starting the ranks ourselves.

Under a launcher (torchrun, srun, mpirun, DeepSpeed's launcher: see `discovery`) every
rank reads its place from the environment. Without one, the driver self-spawns: it hosts the rendezvous store on a port the OS
picks on 127.0.0.1 and starts ranks 1..N-1 as child processes with the same variables.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from meshserve.parallel.comm.discovery import LaunchEnv

SPAWNED_BY = "MESHSERVE_PARENT_PID"
"""Set in self-spawned ranks: the driver's pid (a rank exits when its driver is gone)."""


class RankFailure(RuntimeError):
    """Another rank died, hung or failed: the run cannot go on."""


def failure_reason(error: BaseException) -> str:
    """The first sentence worth printing of an error (gloo's come with advice attached)."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    return text.splitlines()[0].split(" This is typically caused by")[0]


def report_failure(store: dist.Store, rank: int, reason: str, timeout_s: float = 2.0) -> None:
    """Leave `reason` in the store for the driver's error message (best effort: a store that
    is gone or stuck is given up on after `timeout_s`)."""

    def put() -> None:
        try:
            store.set(f"failure/{rank}", reason)
        except Exception:  # noqa: BLE001 - best effort
            pass

    t = threading.Thread(target=put, daemon=True)
    t.start()
    t.join(timeout_s)


def reported_failure(store: dist.Store, rank: int) -> str | None:
    """What rank `rank` said when it failed, if it said anything."""
    key = f"failure/{rank}"
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001 - the message is a courtesy
        return None


def self_spawned_driver(world_size: int, port: int) -> LaunchEnv:
    """Rank 0 of a run whose other ranks this process starts on this machine."""
    return LaunchEnv(launcher="self-spawn", rank=0, world_size=world_size, local_rank=0,
                     local_world_size=world_size, node_rank=0, num_nodes=1,
                     master_addr="127.0.0.1", master_port=port)


_stores: dict[tuple[str, int, int, str], dist.Store] = {}


def _attempt_prefix() -> str:
    return f"meshserve/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def launcher_store(env: LaunchEnv, timeout: timedelta) -> dist.Store:
    """The run's rendezvous store, under a prefix unique to this attempt: torchrun's agent
    store when it hosts one, else a TCP store that rank 0 serves at the discovered address.
    Made once per process (rank 0 serves it on one port) and shared by every caller. A
    replica's own world (`env.world`) has its keys under its namespace in the launched
    world's store."""
    if env.world is not None:
        return dist.PrefixStore(env.namespace, launcher_store(env.world, timeout))
    if env.agent_store:
        url = "env://"
    else:
        url = f"tcp://{env.master_addr}:{env.master_port}"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = (url, env.rank, env.world_size, attempt)
    if key not in _stores:
        store, _, _ = next(rendezvous(url, rank=env.rank, world_size=env.world_size,
                                      timeout=timeout))
        _stores[key] = dist.PrefixStore(_attempt_prefix(), store)
    return _stores[key]


@dataclass(frozen=True)
class StoreAddress:
    """Where a new client connection reaches a store's keys: a TCP store and a prefix."""

    host: str
    port: int
    prefix: str = ""

    def open(self, timeout: timedelta) -> dist.Store:
        """A connection of its own (waits on it never hold up another's)."""
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        return dist.PrefixStore(self.prefix, store) if self.prefix else store


def launcher_store_address(env: LaunchEnv) -> StoreAddress:
    """Where `launcher_store(env)`'s keys are, for connections of their own (torchrun's
    agent store and rank 0's both serve at the rendezvous address)."""
    world = env.world or env
    prefix = _attempt_prefix() + (f"/{env.namespace}" if env.world is not None else "")
    return StoreAddress(world.master_addr, world.master_port, prefix)


def store_barrier(store: dist.Store, name: str, world_size: int, timeout_s: float,
                  check: Callable[[], None] = lambda: None) -> None:
    """Wait until all `world_size` ranks reached `name`; `check` raises to stop waiting."""
    store.add(name, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(name, 0) < world_size:
        check()
        if time.monotonic() > deadline:
            raise RankFailure(f"only {store.add(name, 0)} of {world_size} ranks reached "
                              f"'{name}' within {timeout_s:.0f} s")
        time.sleep(0.05)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class SpawnedRanks:
    """Ranks 1..N-1 of a self-spawned run: child processes this driver owns and reaps."""

    def __init__(self, world_size: int, module: str, payload: bytes, threads_per_rank: int,
                 timeout: timedelta) -> None:
        self.world_size = world_size
        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                    timeout=timeout, wait_for_workers=False)
        self.port = self._store.port
        self.store: dist.Store | None = dist.PrefixStore("meshserve/0", self._store)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.failure: str | None = None
        self._stopping = False
        base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port),
                    WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                    OMP_NUM_THREADS=str(threads_per_rank), **{SPAWNED_BY: str(os.getpid())})
        base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        try:
            for rank in range(1, world_size):
                env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
                proc = subprocess.Popen([sys.executable, "-m", module], env=env,
                                        stdin=subprocess.PIPE)
                self.procs[rank] = proc
                assert proc.stdin is not None
                proc.stdin.write(payload)
                proc.stdin.close()
        except BaseException:
            self.stop(grace_s=0.0)
            raise
        self._watch = threading.Thread(target=self._watch_children, name="meshserve-ranks",
                                       daemon=True)
        self._watch.start()

    def _watch_children(self) -> None:
        """Stop every rank as soon as one dies: no rank outlives a failed run."""
        while not self._stopping:
            if self._poll() is not None:
                self._kill_all(signal.SIGTERM)
                return
            time.sleep(0.1)

    def _poll(self) -> str | None:
        """The first rank found dead (recorded in `failure`), unless they are expected to exit."""
        if self.failure is None and not self._stopping:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    self.failure = f"rank {rank} {_describe_exit(code)}"
                    if self.store is not None and code > 0:
                        said = reported_failure(self.store, rank)
                        self.failure += f" ({said})" if said else ""
                    break
        return self.failure

    def wait_for_failure(self, timeout_s: float) -> str | None:
        """A rank's death seen within `timeout_s` (the cause of a failed collective), or None."""
        deadline = time.monotonic() + timeout_s
        while self._poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.failure

    def check(self) -> None:
        """Raise RankFailure if a rank has died."""
        if self._poll() is not None:
            raise RankFailure(self.failure)

    def _kill_all(self, sig: signal.Signals) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def wait(self, timeout_s: float) -> bool:
        """Wait for every rank to exit; False if some are still running after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def expect_exit(self) -> None:
        """The ranks are about to be told to exit: their exits are no failure any more."""
        self._stopping = True

    def stop(self, grace_s: float = 5.0) -> None:
        """Let the ranks exit on their own for `grace_s`, then terminate, then kill them;
        reap all of them and close the store (its port is free afterwards)."""
        self._stopping = True
        if not self.wait(grace_s):
            self._kill_all(signal.SIGTERM)
            if not self.wait(2.0):
                self._kill_all(signal.SIGKILL)
                self.wait(10.0)
        self.store = None
        self._store = None  # type: ignore[assignment]  # the last reference: the server closes


def watch_parent(parent_pid: int, on_lost: Callable[[], None]) -> None:
    """Call `on_lost` (on a daemon thread) once the process `parent_pid` is gone."""

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        on_lost()

    threading.Thread(target=run, name="meshserve-parent", daemon=True).start()
