"""Data-parallel replicas under a launcher (torchrun, srun, mpirun): the launched world of
dp x pp x tp ranks splits into dp replicas by the mesh's placement (each TP group on one
node), every replica with its own driver, scheduler and KV cache. Disaggregated replicas
may differ in tp and pp: each then forms a world of its own (its own process groups, its
keys under its namespace in the launched world's store), as self-spawned replicas do.

World rank 0 drives replica 0 and hosts the front (the offline API or the HTTP server)
and the router; the driver of replica d > 0 runs its engine and takes the front's
commands over a TCP connection, as a self-spawned replica does over its socket pair
(engine/replicas/replica.py); every other rank serves its replica's driver. The front listens
before any engine starts and publishes its address and a one-time token in the run's
store; a driver connects and sends the token, then starts its engine beside the others.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection

import torch.distributed as dist

from meshserve.engine.config.run import Run
from meshserve.parallel.comm.mesh import ParallelDims, place_replicas
from meshserve.parallel.comm.ranks import RankFailure, launcher_store, launcher_store_address

FRONT_KEY = "dp/front"
"""Store key of the front's "host port token"."""
STARTUP_TIMEOUT_S = 600.0
"""Longest a rank waits for the others to publish their nodes or the front its address."""


@dataclass(frozen=True)
class LaunchedPlace:
    """This rank's part in a launched data-parallel run."""

    replica: int
    """Its replica (dp index)."""
    driver_ranks: tuple[int, ...]
    """Every replica's driver, by replica."""
    rank: int
    members: tuple[int, ...] = ()
    """Its replica's ranks in mesh order (pp, tp), the driver first."""

    @property
    def is_driver(self) -> bool:
        return self.driver_ranks[self.replica] == self.rank

    @property
    def is_front(self) -> bool:
        return self.rank == 0


def _store(run: Run) -> dist.Store:
    assert run.env is not None
    timeout = max(STARTUP_TIMEOUT_S, run.config.parallel.timeout_s)
    return launcher_store(run.env.world or run.env, timedelta(seconds=timeout))


def launched_store(run: Run) -> dist.Store:
    """A client of the launched world's store (every rank of every replica reaches it)."""
    return _store(run)


def own_launched_store(run: Run) -> dist.Store:
    """A connection of its own to `launched_store`'s keys (for a thread beside another
    that uses that one)."""
    assert run.env is not None
    timeout = max(STARTUP_TIMEOUT_S, run.config.parallel.timeout_s)
    return launcher_store_address(run.env.world or run.env).open(timedelta(seconds=timeout))


def replica_layouts(run: Run, world_size: int) -> list[tuple[int, int]]:
    """(tp, pp) of each launched replica: disaggregated ones by phase (prefill first),
    else dp alike."""
    config = run.config
    d = config.disagg
    if d.enabled:
        layouts = [(d.phase_of(i).tp, d.phase_of(i).pp) for i in range(d.num_replicas)]
        if sum(tp * pp for tp, pp in layouts) != world_size:
            raise ValueError(
                f"disagg.prefill (replicas={d.prefill.replicas}, tp={d.prefill.tp}, "
                f"pp={d.prefill.pp}) and disagg.decode (replicas={d.decode.replicas}, "
                f"tp={d.decode.tp}, pp={d.decode.pp}) take "
                f"{sum(tp * pp for tp, pp in layouts)} ranks, but the launcher started "
                f"{world_size}: allowed are phases whose ranks add up to the world size")
        return layouts
    dims = ParallelDims.from_config(config.parallel, world_size)
    return [(dims.tp, dims.pp)] * dims.dp


def launched_place(run: Run) -> LaunchedPlace:
    """Where this rank sits, from the nodes every rank publishes in the run's store (the
    mesh's own placement: each TP group on one node, replicas in order of their ranks)."""
    env = run.env
    assert env is not None, "a launched run"
    layouts = replica_layouts(run, env.world_size)
    store = _store(run)
    store.set(f"dp/node/{env.rank}", env.node_id)
    keys = [f"dp/node/{r}" for r in range(env.world_size)]
    store.wait(keys, timedelta(seconds=max(STARTUP_TIMEOUT_S, run.config.parallel.timeout_s)))
    replicas = place_replicas([store.get(k).decode() for k in keys], layouts)
    replica = next(i for i, ranks in enumerate(replicas) if env.rank in ranks)
    return LaunchedPlace(replica=replica, driver_ranks=tuple(r[0] for r in replicas),
                        rank=env.rank, members=tuple(replicas[replica]))


def launched_replica_run(run: Run, place: LaunchedPlace) -> Run:
    """This rank's replica as its ranks run it. Disaggregated: its phase's tp and pp in a
    world of its own (a LaunchEnv whose rank and size count the replica's ranks). Else
    the launched run as it is (data-parallel replicas share the launched world's
    groups)."""
    config = run.config
    if not config.disagg.enabled:
        return run
    assert run.env is not None
    phase = config.disagg.phase_of(place.replica)
    own = replace(config, parallel=replace(config.parallel, tp=phase.tp, pp=phase.pp, dp=1))
    env = replace(run.env, rank=place.members.index(place.rank), world_size=len(place.members),
                  world=run.env, namespace=f"replica{place.replica}")
    return replace(run.with_config(own), env=env)


def _reachable_host(master_addr: str) -> str:
    """This host's address on the route to the rendezvous host (what the other nodes can
    reach it at)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))  # no packet is sent: it only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


class FrontListener:
    """The front's end: listens, publishes its address, accepts each replica's driver."""

    def __init__(self, run: Run) -> None:
        assert run.env is not None
        self._server = socket.create_server(("", 0))
        self._token = secrets.token_bytes(16)
        host = _reachable_host(run.env.master_addr)
        port = self._server.getsockname()[1]
        _store(run).set(FRONT_KEY, f"{host} {port} {self._token.hex()}")

    def accept(self, num_replicas: int, timeout_s: float) -> dict[int, Connection]:
        """A connection to each of replicas 1..num_replicas-1, by replica."""
        conns: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(conns) < num_replicas - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, num_replicas)) - set(conns))
                    raise RankFailure(f"data-parallel replicas {missing} did not connect to "
                                      f"the front within {timeout_s:.0f} s")
                self._server.settimeout(left)
                try:
                    sock, _ = self._server.accept()
                except TimeoutError:
                    continue
                sock.settimeout(None)
                conn = Connection(sock.detach())
                if not conn.poll(min(left, 30.0)):
                    conn.close()
                    continue
                hello = conn.recv_bytes(maxlength=64)
                token, replica = hello[:16], int.from_bytes(hello[16:20], "big")
                if not hmac.compare_digest(token, self._token) or not 0 < replica < num_replicas:
                    conn.close()  # not one of this run's drivers
                    continue
                conns[replica] = conn
        finally:
            self._server.close()
        return conns


def connect_front(run: Run, replica: int) -> Connection:
    """A replica driver's connection to the front (which listens before any engine
    starts)."""
    store = _store(run)
    timeout = max(STARTUP_TIMEOUT_S, run.config.parallel.timeout_s)
    store.wait([FRONT_KEY], timedelta(seconds=timeout))
    host, port, token = store.get(FRONT_KEY).decode().split()
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send_bytes(bytes.fromhex(token) + replica.to_bytes(4, "big"))
    return conn
