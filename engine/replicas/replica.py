"""A data-parallel replica's process: `python -m meshserve.engine.replicas.replica FD`, or under a
launcher the driver rank of a replica (engine/replicas/launched.py); replica 0 is served
the same way from a thread of the front's process (`serve_in_thread`).

Started by `data_parallel.DataParallelEngine` with one end of a socket pair as FD (or
connected to the launched front over TCP). The first message is the replica's resolved
Run (a launched driver has its own); then it runs its own Engine (and that engine's
tp x pp ranks), taking the front's commands (engine/replicas/messages.py) and sending back
every step's outputs with its counters. A thread sends a heartbeat every BEAT_S, so the front
tells a long step from a hung replica. It exits when told to stop or when the front is
gone.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from meshserve.engine.config.run import Run
from meshserve.engine.engine import Engine
from meshserve.engine.kv_transfer.peers import KV_STARTUP_S
from meshserve.engine.replicas.inbox import Inbox
from meshserve.engine.replicas.kv_handoff import KVHandoff, kv_handoff
from meshserve.engine.replicas.launched import connect_front, launched_store
from meshserve.engine.replicas.messages import (
    Abort,
    Add,
    Beat,
    Failed,
    HandoffReply,
    KVStoreAt,
    Outputs,
    PrefixCacheReset,
    Ready,
    ReplicaMessage,
    ResetPrefixCache,
    Stats,
    Stop,
)
from meshserve.engine.replicas.output_deltas import OutputPacker

BEAT_S = 1.0
"""Seconds between heartbeats."""


class _Sender:
    """Sends on `conn` from the main thread and the heartbeat thread, one at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock, self.stopped = conn, threading.Lock(), threading.Event()
        threading.Thread(target=self._beat, name="meshserve-replica-beat", daemon=True).start()

    def send(self, msg: ReplicaMessage) -> None:
        with self.lock:
            self.conn.send(msg)

    def _beat(self) -> None:
        while not self.stopped.wait(BEAT_S):
            try:
                self.send(Beat())
            except OSError:
                return


def serve_replica(conn: Connection) -> int:
    """Run the replica until Stop or the front's end of `conn` closes."""
    run = conn.recv()
    out = _Sender(conn)
    try:
        return _serve(run, conn, out)
    finally:
        out.stopped.set()


def _kv_handoff(engine: Engine, run: Run, at: KVStoreAt) -> KVHandoff:
    """This replica's KV hand-off, its store where the front's message says."""
    if at.host is None or at.port is None:  # launched: the launcher's store
        return kv_handoff(engine, run, at.index, launched_store(run), None)
    store = dist.TCPStore(at.host, at.port, at.world, False,
                          timeout=timedelta(seconds=KV_STARTUP_S))
    return kv_handoff(engine, run, at.index, store, (at.host, at.port))


def serve_launched_replica(run: Run, replica: int) -> int:
    """A launched replica's driver (rank != 0 under torchrun, srun or mpirun): connect to
    the front, then run the replica's engine for it until Stop or the front is gone."""
    conn = connect_front(run, replica)
    out = _Sender(conn)
    try:
        return _serve(run, conn, out)
    finally:
        out.stopped.set()


def _serve(run: Run, conn: Connection, out: _Sender) -> int:
    try:
        engine = Engine(run, progress=False)
    except BaseException as e:  # noqa: BLE001 - reported to the front
        out.send(Failed(f"{type(e).__name__}: {e}"))
        return 1
    return serve_engine(engine, conn, out)


def serve_in_thread(engine: Engine, conn: Connection, index: int) -> threading.Thread:
    """Serve `engine` (built in this process: replica 0 beside the front) on `conn` from a
    thread of its own, as a replica process would, so the front's loop never waits on its
    steps. The thread shuts the engine down when it ends."""
    def run() -> None:
        if engine.run.config.threads:
            torch.set_num_threads(engine.run.config.threads)  # (set per thread)
        if engine.device.type == "cuda":
            torch.cuda.set_device(engine.device)  # (current per thread too)
        out = _Sender(conn)
        try:
            serve_engine(engine, conn, out)
        finally:
            out.stopped.set()
            conn.close()

    thread = threading.Thread(target=run, name=f"meshserve-replica-{index}", daemon=True)
    thread.start()
    return thread


def serve_engine(engine: Engine, conn: Connection, out: _Sender) -> int:
    """Take the front's commands and step `engine` until Stop or the front is gone (0),
    or an error, sent to the front (1); the engine is shut down either way."""
    handoff: KVHandoff | None = None
    try:
        if engine.run.config.disagg.enabled:  # the front's next message: the KV store
            at = conn.recv()
            assert isinstance(at, KVStoreAt), at
            handoff = _kv_handoff(engine, engine.run, at)
        out.send(Ready(engine.num_blocks, engine.stats))
        _loop(engine, handoff, conn, out)
        return 0
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the front is gone
        return 0
    except BaseException as e:  # noqa: BLE001 - reported to the front
        try:
            out.send(Failed(f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return 1
    finally:
        if handoff is not None:
            handoff.close()
        engine.shutdown()


def _loop(engine: Engine, handoff: KVHandoff | None, conn: Connection, out: _Sender) -> None:
    inbox = Inbox(conn, handoff, out)
    lock = inbox.handoff_lock
    packer = OutputPacker()
    told = engine.stats
    """The counters the front has (blocks freed by a command change them too)."""
    while True:
        idle = not engine.has_unfinished() and not (handoff is not None and handoff.busy)
        if idle and inbox.empty():  # about to wait: the front's counters up to date first
            now = engine.stats
            if now != told:
                told = now
                out.send(Stats(told))
        # idle: wait for a message; a transfer or a lease outstanding: look again soon
        msg = inbox.get(None if idle else 0.0 if engine.has_unfinished() else 0.002)
        while msg is not None:
            match msg:
                case Stop():
                    return
                case Add(ids, params, request_id, arrival):
                    engine.add_request(ids, params, request_id, arrival)
                case Abort(request_id):
                    engine.abort(request_id)
                    packer.forget(request_id)
                    if handoff is not None:
                        with lock:
                            _send_all(out, handoff.abort(request_id))
                case ResetPrefixCache():
                    n = engine.reset_prefix_cache()
                    told = engine.stats
                    out.send(PrefixCacheReset(n, told))
                case KVStoreAt():
                    raise RuntimeError(f"the KV store's address again: {msg}")
                case _:
                    if handoff is None:
                        raise RuntimeError(f"a disaggregation message to a replica that is "
                                           f"not disaggregated: {msg}")
                    with lock:
                        _send_all(out, handoff.command(msg))
            msg = inbox.get(0.0)
        if handoff is not None:
            with lock:
                _send_all(out, handoff.poll())
        if not engine.has_unfinished():
            continue
        outs = engine.step()  # (exports go on meanwhile, in the inbox's thread)
        if outs:
            told = engine.stats
            out.send(Outputs(packer.pack(outs), told))
        if handoff is not None:
            with lock:
                _send_all(out, handoff.after_step(outs))


def _send_all(out: _Sender, replies: list[HandoffReply]) -> None:
    for reply in replies:
        out.send(reply)


def main(argv: list[str] | None = None) -> int:
    """Entry point: the file descriptor of the replica's end of the socket pair."""
    (fd,) = (argv if argv is not None else sys.argv[1:])[:1]
    return serve_replica(Connection(int(fd)))


if __name__ == "__main__":
    sys.exit(main())
