"""One replica's part in disaggregated serving, driven by the front's messages.

A prefill replica runs a request's prompt with max_tokens=1; when it finishes for its
length, the prompt's full blocks are pinned under a lease (engine/kv_transfer/leases.py) and the
front is told (Held). As the front sends the import to a decode replica it tells this
replica to Export: the lease's read begins (or is refused: expired, aborted) and is
announced in the KV store; ReadDone ends the read and unpins them. (The messages are in
engine/replicas/messages.py.) Leases nobody reads
lapse after disagg.kv_lease_s and are counted.

A decode replica told to Import a request pins what its prefix cache already holds of
the prompt and takes fresh blocks for the rest (`BlockManager.begin_import`); if nothing
is missing, or no block is free, it admits the request at once (then it prefills what it
lacks itself). Otherwise, once it sees the grant in the KV store, a thread pulls the
blocks in (the connector's decode side reads; the prefill replica's steps take no part);
when the thread is done the blocks enter its prefix cache and the request (its prompt
plus the first token) is admitted, a prefix hit for all but its last block. An abort at
any point frees what the request holds on this side, once no thread still uses it.

A streamed prompt (disagg.stream_kv) is read as it is computed: its decode replica is told
(Stream) as it is sent to its prefill replica. As each step is launched the prefill
replica pins the blocks it completes of the prompt, and lists them in the KV store once
the step has run (the step that ends the prompt after each layer too, with the layers
written: engine/kv_transfer/listing.py), where the decode replica looks: at the first listed, it takes blocks for the prompt's full blocks
(or refuses: nothing missing, or too little room left for its running sequences), then
reads what is new, one part at a time (the layers each block lacks). The import that
follows the first token then moves only what is left (the last layers of the last step's
blocks, and the tail). The prefill replica keeps those pins until the front says the read
is done (ReadDone), whatever happens to the request meanwhile.

Everything but the transfers themselves runs on the replica's main thread; the threads
touch only pinned blocks and report through a queue.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch.distributed as dist

from meshserve.engine.config.run import Run
from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.core.scheduler_output import SchedulerOutput
from meshserve.engine.core.sequence import Sequence
from meshserve.engine.engine import Engine
from meshserve.engine.kv_transfer.agent import (
    FannedOut,
    replica_store_address,
    store_opener,
    tell_ranks,
)
from meshserve.engine.kv_transfer.connector import KVConnector, ReadStillActive
from meshserve.engine.kv_transfer.factory import make_connector, resolve_connector
from meshserve.engine.kv_transfer.leases import KVLeases, LeaseExpired
from meshserve.engine.kv_transfer.listing import Listed, StreamLister, moves
from meshserve.engine.kv_transfer.peers import KVPeers, handshake
from meshserve.engine.kv_transfer.pieces import RankKV
from meshserve.engine.replicas.kv_exchange import driver_worker, kv_spec
from meshserve.engine.replicas.kv_imports import PendingImport, PlannedStream, Read, ReadReport
from meshserve.engine.replicas.messages import (
    Export,
    Granted,
    HandoffCommand,
    HandoffReply,
    Held,
    Import,
    ImportCancelled,
    Imported,
    ImportFailed,
    LeaseLapsed,
    Prefill,
    ReadDenied,
    ReadDone,
    Stream,
    StreamRefused,
)
from meshserve.parallel.comm.ranks import StoreAddress, launcher_store_address

FAULT_ENV = "MESHSERVE_KV_FAULT_DELAY"
"""Fault injection (tests): `held=S` holds a prefill replica's word that it holds a
prompt's KV for S seconds (its lease may lapse meanwhile), `pull=S` starts each transfer
S seconds late (an abort may come while it is in flight), `list=S` has a prefill replica
wait S seconds after a step in which it listed a streamed prompt's blocks (a slow
prefill, which the reads overlap), `layer=S` after each layer of such a step but the last
(a slow layer, which the reads of the ones before overlap), `stuck=S` has each transfer
hang S seconds and then fail as one still writing into its blocks (a READ neither done nor
cancellable: ReadStillActive); comma-separated."""


def fault_delays() -> dict[str, float]:
    """The delays FAULT_ENV asks for, by kind."""
    spec = os.environ.get(FAULT_ENV, "")
    out: dict[str, float] = {}
    for item in filter(None, spec.split(",")):
        kind, _, seconds = item.partition("=")
        if kind not in ("held", "pull", "list", "layer", "stuck"):
            raise ValueError(f"{FAULT_ENV}={spec!r}: unknown kind {kind!r}; allowed: "
                             "held=S, pull=S, list=S, layer=S, stuck=S")
        out[kind] = float(seconds)
    return out


def decode_params(params: SamplingParams) -> SamplingParams:
    """A request's params on its decode replica, which starts after the first token (the
    prefill replica scored the prompt, where asked: the decode replica scores nothing)."""
    return replace(params, max_tokens=params.max_tokens - 1,
                   min_tokens=max(0, params.min_tokens - 1), prompt_logprobs=None)


STREAM_POLL_S = 0.005
"""How often a decode replica looks for streamed prompts' newly computed blocks."""


STREAM_RESERVE = 0.05
"""Share of a decode replica's blocks a streamed prompt must leave free (its running
sequences grow into them)."""

def kv_handoff(engine: Engine, run: Run, index: int, store: dist.Store,
            addr: tuple[str, int] | None) -> KVHandoff:
    """Replica `index`'s KV hand-off and connector, made with every other rank's after the
    handshake. `store` is the KV world's store, at `addr` (None: the launcher's), where a
    multi-rank replica's other ranks connect too."""
    d = run.config.disagg
    handshake(store, index, kv_spec(engine))
    env = engine.run.env
    if addr is not None:
        kv_world = StoreAddress(*addr)
    else:  # launched: the KV world's store is the launcher's
        assert env is not None
        kv_world = launcher_store_address(env.world or env)
    peers = KVPeers(store, d.ranks_per_replica, store_opener(kv_world))
    worker = driver_worker(engine)
    assert worker.runner is not None
    cache = worker.runner.kv_cache
    par = engine.config.parallel
    me = RankKV.of(peers.offsets[index], worker.layer_range, 0, par.tp,
                   engine.arch.num_key_value_heads)
    name = resolve_connector(d.connector)
    num_ranks = par.tp * par.pp
    ranks_store = None
    if num_ranks > 1:  # the other ranks join the KV world before this rank waits on it
        port = getattr(engine.executor, "rendezvous_port", None)
        if port is not None:  # self-spawned ranks: their own run's store
            ranks_at = StoreAddress("127.0.0.1", port)
        elif env is not None and env.world is not None:  # a launched replica's own world
            ranks_at = replica_store_address(env)
        else:
            raise ValueError(f"disagg with a replica of tp={par.tp}, pp={par.pp}: its ranks "
                             "must be self-spawned or a launched replica's own world")
        ranks_store = store_opener(ranks_at)
        tell_ranks(ranks_store(), kv_world, index, d.ranks_per_replica, name,
                   d.transfer_timeout_s, d.torch_shm, d.torch_wire)
    connector = make_connector(name, me, index, cache, peers, d.transfer_timeout_s,
                               d.torch_shm, d.torch_wire)
    if ranks_store is not None:
        connector = FannedOut(connector, ranks_store, num_ranks)
    return KVHandoff(engine, connector, d.kv_lease_s)


class KVHandoff:
    """A replica's KV leases (prefill side) and imports (decode side)."""

    def __init__(self, engine: Engine, connector: KVConnector, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine, self.connector, self.clock = engine, connector, clock
        self.bm = engine.scheduler.block_manager
        self.leases = KVLeases(lease_s)
        self._prefills: dict[str, tuple[list[int], Sequence]] = {}
        """Requests prefilled here for a decode replica -> their prompt ids."""
        self._imports: dict[str, PendingImport] = {}
        self._results: queue.Queue[ReadReport] = queue.Queue()
        """What the transfer threads report."""
        self.num_failed = 0
        self.bytes_received = 0
        self._delays = fault_delays()
        self._held_back: list[tuple[float, HandoffReply]] = []
        """Replies FAULT_ENV holds back, with when they go."""
        self._planned: dict[str, PlannedStream] = {}
        self._reserve = max(1, int(self.bm.num_blocks * STREAM_RESERVE))
        self._num_layers = engine.arch.num_hidden_layers
        self._next_look = 0.0
        worker = driver_worker(engine)
        self._lister = StreamLister(worker.layer_range, self._publish,
                                    engine.device.type == "cuda")
        self._listed_before = 0
        # Rank 0's hook speaks for a tensor-parallel replica's other ranks: every layer ends
        # in an all-reduce (models/llama.py), which no rank leaves before all have written
        # the layer's KV.
        if worker.layer_range == (0, self._num_layers):  # (no stream on a pipeline)
            worker.observe_layers(self._slow_layer if "layer" in self._delays
                                  else self._lister.layer_done)
            engine.observe_launches(self._launched)

    # --- the front's commands ------------------------------------------------------------

    def command(self, msg: HandoffCommand) -> list[HandoffReply]:
        """Handle one of the front's disaggregation messages; the replies."""
        match msg:
            case Prefill(ids, params, rid, arrival, stream):
                self.engine.add_request(ids, params, rid, arrival)
                seq = self.engine.sequence(rid)
                assert seq is not None
                seq.keep_tail = True  # a finish for its length keeps its partial last block
                self._prefills[rid] = (list(ids), seq)
                if stream is not None and self.bm.sliding_window is None:
                    self._lister.add(rid, stream.transfer_id, stream.decode)
                return []
            case Stream(rid, ids, src, transfer_id):
                self._planned[rid] = PlannedStream(list(ids), src, transfer_id)
                return []
            case Export(rid, transfer_id):
                return self._export(rid, transfer_id)
            case ReadDone(rid):
                lister_stream = self._lister.pop(rid)
                if lister_stream is not None:
                    self.bm.unpin(lister_stream.pinned)
                # (a stream may end before its lease's read begins: the lease stays)
                if self.leases.reading(rid):
                    self._end_read(rid)
                return []
            case Import():
                return self._import(msg)
            case ImportCancelled(rid, _why):
                self._planned.pop(rid, None)
                self._drop_import(rid)
                return []
        raise ValueError(f"unknown disaggregation message {msg!r}")

    def abort(self, rid: str) -> list[HandoffReply]:
        """Free whatever `rid` holds here (once no thread uses it). The reply: an import
        whose read was announced but not begun here ends, so the front ends the read
        (its grant may have reached the front before the abort)."""
        self._prefills.pop(rid, None)
        self.bm.unpin(self.leases.abort(rid))
        self._lister.close_stream(rid)  # (its pins go when the read is done)
        if self._planned.pop(rid, None) is not None:
            return [ImportFailed(rid, "aborted")]
        dropped = self._drop_import(rid)
        return [ImportFailed(rid, "aborted")] if dropped else []

    def _drop_import(self, rid: str) -> PendingImport | None:
        """Free an import's blocks, or have its thread's end free them (a pull announced
        in the store may be running when a denial comes: its prefill replica was lost).
        The import freed here, if one was (no thread's end will report it)."""
        job = self._imports.get(rid)
        if job is None:
            return None
        if job.running:
            job.aborted = True
            return None
        del self._imports[rid]
        self._give_back(job)
        return job

    def after_step(self, outs: list[RequestOutput]) -> list[HandoffReply]:
        """Hold the KV of prompts prefilled here that finished for their length: every
        full block, then the block of the tokens after them (kept at the finish), so the
        decode replica computes only the first token's."""
        if self._lister.num_listed > self._listed_before:
            self._listed_before = self._lister.num_listed
            time.sleep(self._delays.get("list", 0.0))
        replies: list[HandoffReply] = []
        for out in outs:
            if not out.finished or out.request_id not in self._prefills:
                continue
            self._lister.close_stream(out.request_id)
            ids, seq = self._prefills.pop(out.request_id)
            tail, seq.kv_tail = ([] if seq.kv_tail is None else [seq.kv_tail]), None
            if out.finish_reason != "length":  # stopped at its first token: nothing to ship
                self.bm.unpin(tail)
                continue
            blocks = self.bm.pin_prefix(ids + out.token_ids[:1])
            if len(blocks) == len(ids) // self.bm.block_size:
                blocks += tail
            else:  # a full block before it is missing: the decode side computes it
                self.bm.unpin(tail)
            self.leases.hold(out.request_id, blocks, self.clock())
            held = Held(out.request_id, blocks)
            if "held" in self._delays:
                self._held_back.append((self.clock() + self._delays["held"], held))
            else:
                replies.append(held)
        return replies

    def poll(self) -> list[HandoffReply]:
        """Finish transfers the threads are done with; lapse unread leases."""
        replies: list[HandoffReply] = []
        while True:
            try:
                done = self._results.get_nowait()
            except queue.Empty:
                break
            if done.part:
                replies += self._part_landed(done)
            else:
                replies += self._finish_pull(done)
        now = self.clock()
        listed = self._look_listed(now)
        for rid, plan in list(self._planned.items()):
            if plan.src in listed:
                replies += self._begin_stream(rid, plan, listed[plan.src].get(plan.transfer_id))
        for rid, job in list(self._imports.items()):
            if job.running:
                continue
            if not job.final:
                part = listed.get(job.src, {}).get(job.transfer_id)
                if job.error is None and part is not None:
                    self._pull_part(rid, job, part)
            elif job.announced and self.connector.peers.grant_announced(job.transfer_id):
                self._start_pull(rid)
        for rid, blocks in self.leases.expire(self.clock()):
            self.bm.unpin(blocks)
            replies.append(LeaseLapsed(rid))
        now = self.clock()
        replies += [msg for at, msg in self._held_back if at <= now]
        self._held_back = [(at, msg) for at, msg in self._held_back if at > now]
        return replies

    def _look_listed(self, now: float) -> dict[int, dict[int, Listed]]:
        """Every STREAM_POLL_S, what each prefill replica this side waits on lists for it
        (one read each, however many prompts)."""
        if now < self._next_look:
            return {}
        srcs = {p.src for p in self._planned.values()} | {
            j.src for j in self._imports.values() if not j.final and not j.running}
        if not srcs:
            return {}
        self._next_look = now + STREAM_POLL_S
        me = self.connector.replica
        return {src: self.connector.peers.listed(src, me) for src in srcs}

    @property
    def busy(self) -> bool:
        """Whether a lease, an import or a transfer is outstanding here."""
        return bool(len(self.leases) or self._imports or self._held_back
                    or self._planned)

    @property
    def num_expired(self) -> int:
        return self.leases.num_expired

    def close(self) -> None:
        self._lister.close()
        self.connector.close()

    # --- prefill side --------------------------------------------------------------------

    def _export(self, rid: str, transfer_id: int) -> list[HandoffReply]:
        """Begin the lease's read (refused if it lapsed or was aborted) and announce it in
        the KV store, where the decode replica looks."""
        try:
            self.leases.begin_read(rid, self.clock())
        except LeaseExpired as e:
            return [ReadDenied(rid, str(e))]
        self.connector.peers.announce_grant(transfer_id)
        return [Granted(rid)]

    def _end_read(self, rid: str) -> None:
        self.bm.unpin(self.leases.end_read(rid))

    def _launched(self, out: SchedulerOutput) -> None:
        """A step is about to run: pin the blocks it completes of streamed prompts."""
        self._lister.launched(out.num_batched_tokens,
                              lambda rid: self._prompt_blocks_scheduled(rid, out),
                              self.bm.pin)

    def _prompt_blocks_scheduled(self, rid: str, out: SchedulerOutput
                                 ) -> tuple[list[int], int, bool]:
        """The request's full prompt blocks once step `out` (scheduled, not launched) and
        the steps launched before it have run, in order; how often it was preempted; and
        whether `out` ends its prompt. ([], 0, False) for a request not here."""
        seq = self.engine.sequence(rid)
        if seq is None:
            return [], 0, False
        chunk = next((s for s in out.scheduled if s.seq_id == seq.seq_id), None)
        table, end = ((seq.block_table, seq.num_computed_tokens) if chunk is None
                      else (chunk.block_table, chunk.start_pos + chunk.num_tokens))
        end = min(end, seq.num_prompt_tokens)
        blocks = list(table[:end // self.bm.block_size])
        return blocks, seq.num_preemptions, chunk is not None and end == seq.num_prompt_tokens

    def _slow_layer(self, layer: int, num_tokens: int) -> None:
        """(FAULT_ENV's layer=S) The lister's hook, then a pause after a layer listed."""
        before = self._lister.num_listed
        self._lister.layer_done(layer, num_tokens)
        if self._lister.num_listed > before and layer + 1 < self._num_layers:
            time.sleep(self._delays["layer"])

    def _publish(self, dst: int, listed: dict[int, Listed]) -> None:
        self.connector.peers.publish_listed(self.connector.replica, dst, listed)

    # --- decode side ---------------------------------------------------------------------

    def _begin_stream(self, rid: str, plan: PlannedStream, ready: Listed | None
                      ) -> list[HandoffReply]:
        """Once the prompt's first block is listed, take blocks for the full blocks this
        side lacks and start reading (refused: nothing missing, or too little room left;
        the import then comes as for any prompt)."""
        if ready is None or not ready.blocks:
            return []
        del self._planned[rid]
        imp = self.bm.begin_import(plan.ids + [0])  # (a stand-in first token)
        if imp is not None and (not imp.blocks or self.bm.num_free_blocks < self._reserve):
            self.bm.finish_import(imp, written=False)
            imp = None
        if imp is None:
            return [StreamRefused(rid)]
        job = PendingImport(imp, plan.ids, None, 0.0, plan.src, [], plan.transfer_id,
                      announced=True, streamed=True, final=False)
        self._imports[rid] = job
        self._pull_part(rid, job, ready)
        return []

    def _pull_part(self, rid: str, job: PendingImport, ready: Listed) -> None:
        """Read what is newly listed of a streamed prompt's blocks (the layers each one
        lacks), in a thread."""
        first = job.imp.first_block
        want = [ready.layers_of(first + i, self._num_layers) for i in range(len(job.have))]
        reads = [(ready.blocks[first + a:first + b], job.imp.blocks[a:b], (lo, hi))
                 for a, b, lo, hi in moves(job.have, want)]
        if not reads:
            return
        job.running = True
        job.pulling = [max(h, w) for h, w in zip(job.have, want, strict=True)]
        threading.Thread(target=self._read, args=(True, rid, job, reads),
                         name=f"meshserve-kv-part-{rid}", daemon=True).start()

    def _part_landed(self, done: ReadReport) -> list[HandoffReply]:
        rid = done.request_id
        job = self._imports[rid]
        job.running = False
        if job.aborted:  # dropped meanwhile: its blocks go now
            del self._imports[rid]
            self._give_back(job)
            return [ImportFailed(rid, "aborted")]
        if done.error is not None:
            job.error = done.error
            job.still_writing |= done.still_writing
        else:
            job.have = job.pulling
            job.nbytes += done.nbytes
            job.wire_s += done.seconds
            if not job.final:
                job.early_bytes += done.nbytes
                job.layered_bytes += done.layered
        if job.final:  # the import came while the part moved
            return self._after_import(rid, job)
        return []

    def _import(self, msg: Import) -> list[HandoffReply]:
        """Take blocks for what the prefix cache lacks of the prompt (`ids`: it and its first
        token) and for the tokens after its last full block if they come too, then pull
        once the prefill replica announces the grant in the KV store (`granted`: the
        front saw it already)."""
        rid, ids, params, arrival = msg.request_id, msg.ids, msg.params, msg.arrival
        src, src_blocks, transfer_id, granted = (msg.src, msg.src_blocks, msg.transfer_id,
                                                 msg.granted)
        bs = self.bm.block_size
        num_full = min(len(src_blocks), (len(ids) - 1) // bs)
        self._planned.pop(rid, None)  # (its prompt was done before a block was listed)
        job = self._imports.get(rid)
        if job is not None and job.streamed:
            job.ids, job.params, job.arrival = ids, params, arrival
            job.src_blocks, job.received, job.final = list(src_blocks), self.clock(), True
            if num_full < job.imp.first_block + len(job.imp.blocks):
                job.error = job.error or (f"prefill replica {src} holds {num_full} of the "
                                          "prompt's full blocks; more were streamed")
            elif len(src_blocks) > num_full and not self.bm.add_import_tail(job.imp):
                job.src_blocks = job.src_blocks[:num_full]  # no room: the tail is computed
            if granted:
                job.announced = False
            return [] if job.running else self._after_import(rid, job)
        shipped = ids[:num_full * bs + 1]  # the full blocks the prefill side holds, + 1 token
        imp = (self.bm.begin_import(shipped, tail=len(src_blocks) > num_full) if src_blocks
               else None)
        if imp is None or not imp.written:  # nothing missing, or no room: prefill here
            if imp is not None:
                self.bm.finish_import(imp, written=True)
            self.engine.add_request(ids, params, rid, arrival)
            return [Imported(rid, 0, 0.0, 0.0)]
        self._imports[rid] = PendingImport(imp, ids, params, arrival, src, src_blocks, transfer_id,
                                     self.clock(), announced=not granted)
        if granted or self.connector.peers.grant_announced(transfer_id):
            self._start_pull(rid)
        return []  # else `poll` starts the pull

    def _after_import(self, rid: str, job: PendingImport) -> list[HandoffReply]:
        """A streamed prompt's import has come and no part is moving: fail it, or read what
        is left once the read is granted (`poll` looks for an announced grant)."""
        if job.error is not None:
            del self._imports[rid]
            self._give_back(job)
            self.num_failed += 1
            return [ImportFailed(rid, job.error)]
        if not job.announced or self.connector.peers.grant_announced(job.transfer_id):
            self._start_pull(rid)
        return []

    def _start_pull(self, rid: str) -> None:
        job = self._imports.get(rid)
        if job is None or job.running:  # aborted meanwhile, or begun already
            return
        job.running = True
        imp = job.imp
        num_full = imp.first_block + len(imp.blocks)
        tail = imp.tail is not None  # (its source: the block after the full ones)
        src = job.src_blocks[imp.first_block:num_full + tail]
        dst = imp.blocks + ([imp.tail] if imp.tail is not None else [])
        have = job.have + [0] * tail
        reads = [(src[a:b], dst[a:b], (lo, hi))
                 for a, b, lo, hi in moves(have, [self._num_layers] * len(have))]
        threading.Thread(target=self._read, args=(False, rid, job, reads),
                         name=f"meshserve-kv-pull-{rid}", daemon=True).start()

    def _read(self, part: bool, rid: str, job: PendingImport, reads: list[Read]) -> None:
        """Every read, in a thread; the bytes, and of them those of layers read while
        their step still ran (all but the last layers)."""
        t0 = time.perf_counter()
        time.sleep(self._delays.get("pull", 0.0))
        n = layered = 0
        try:
            if "stuck" in self._delays:
                time.sleep(self._delays["stuck"])
                raise ReadStillActive(f"{FAULT_ENV}: a read of request {rid!r} stuck")
            for src, dst, layers in reads:
                moved = self.connector.pull(job.src, job.transfer_id, src, dst, layers)
                n += moved
                layered += moved if layers[1] < self._num_layers else 0
        except Exception as e:  # noqa: BLE001 - reported on the main thread
            self._results.put(ReadReport(part, rid, 0, 0, time.perf_counter() - t0, str(e),
                                         isinstance(e, ReadStillActive)))
            return
        self._results.put(ReadReport(part, rid, n, layered, time.perf_counter() - t0, None))

    def _give_back(self, job: PendingImport) -> None:
        """Give back a failed or aborted import's blocks; those a read may still be writing
        into stay out of use."""
        self.bm.finish_import(job.imp, written=False, keep_out=job.still_writing)

    def _finish_pull(self, done: ReadReport) -> list[HandoffReply]:
        rid = done.request_id
        job = self._imports.pop(rid)
        ok = done.error is None and not job.aborted
        job.still_writing |= done.still_writing
        tail = self.bm.finish_import(job.imp, written=ok, keep_out=job.still_writing)
        if job.aborted:
            return [ImportFailed(rid, "aborted")]
        if done.error is not None:
            self.num_failed += 1
            return [ImportFailed(rid, done.error)]
        nbytes, seconds = done.nbytes + job.nbytes, done.seconds + job.wire_s
        self.bytes_received += nbytes
        assert job.params is not None
        self.engine.add_request(job.ids, job.params, rid, job.arrival)
        if tail is not None:
            seq = self.engine.sequence(rid)
            assert seq is not None and seq.kv_tail is None and not seq.block_table, rid
            seq.kv_tail = tail  # its admission takes it in (or frees it: prefix gone)
        return [Imported(rid, nbytes, seconds, self.clock() - job.received, job.early_bytes,
                         job.layered_bytes)]
