"""Disaggregated serving: prefill replicas and decode replicas behind one front.

Replicas 0..P-1 prefill, P..P+D-1 decode; each is a whole engine as in data parallelism
(engine/replicas/data_parallel.py: replica 0 steps in a thread of this process, the others in
their own), and each has a KV connector and a `KVHandoff` (engine/replicas/kv_handoff.py). A request
whose prompt is long enough goes to the prefill replica the cache-aware router picks,
with max_tokens=1; its first token is returned at once. When that replica has pinned the
prompt's KV (Held), the front picks the decode replica (the less loaded of two drawn at
random), tells it to import and tells the prefill replica to grant the read of its lease
(or refuse: lapsed, aborted). The prefill replica announces the grant in the KV store,
where the decode replica looks once it has allocated its blocks, and pulls them; neither
asks through the front. The decode replica admits the request and the prefill replica
unpins the blocks. The request's outputs then come from the decode replica, after the
first token.

With disagg.stream_kv, the decode replica is picked as the prompt goes to its prefill
replica and told at once (Stream): it reads the prompt's blocks as the prefill replica
computes them (engine/replicas/kv_handoff.py), so the import after the first token moves only
the rest. The read counts as begun from then on: whatever ends it (the import, an abort,
a refusal, a lost replica), the prefill replica is told ReadDone (engine/replicas/messages.py).

Short prompts, prompts a decode replica mostly caches, and requests whose later tokens
depend on the first one's state (structured outputs, presence and frequency penalties)
prefill on a decode replica and never hop.

A request whose KV cannot be moved fails with an error output, or with
disagg.on_failure=recompute is prefilled again on its decode replica. An abort reaches
whichever replicas hold something of the request.
"""

from __future__ import annotations

import bisect
import itertools
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshserve.engine.config.run import Run
from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.kv_transfer.factory import resolve_connector
from meshserve.engine.kv_transfer.peers import forget_grant, name_run, sweep_run
from meshserve.engine.replicas.data_parallel import STARTUP_TIMEOUT_S, DataParallelEngine
from meshserve.engine.replicas.kv_handoff import decode_params
from meshserve.engine.replicas.launched import own_launched_store
from meshserve.engine.replicas.messages import (
    Abort,
    Add,
    Export,
    FrontMessage,
    Granted,
    HandoffReply,
    Held,
    Import,
    ImportCancelled,
    Imported,
    ImportFailed,
    KVStoreAt,
    LeaseLapsed,
    Prefill,
    ReadDenied,
    ReadDone,
    Stream,
    StreamRefused,
    StreamTo,
)
from meshserve.engine.replicas.router import CACHE_THRESHOLD, PromptTree, Router, prompt_chain
from meshserve.parallel.comm.ranks import RankFailure

PREFILL, DECODE = "prefill", "decode"


@dataclass
class _Hop:
    """A request that prefills on one replica and decodes on another."""

    ids: list[int]
    params: SamplingParams
    arrival: float
    prefill: int
    chain: list[int]
    """The prompt's `prompt_chain`, hashed once at admission."""
    decode: int | None = None
    first: RequestOutput | None = None
    """The prefill replica's output: the first token."""
    stage: str = PREFILL
    """prefill, held (KV pinned), import (moving), decode."""
    held_blocks: list[int] | None = None
    """The prefill replica's pinned blocks of the prompt, once it holds them."""
    held_at: float = 0.0
    granted: bool = False
    """Whether the prefill replica granted the read (the blocks may be moving)."""
    import_sent_at: float = 0.0
    """When the front told the decode replica to import (its clock)."""
    streamed: bool = False
    """Whether `decode` reads the prompt's blocks as they are computed (under
    `transfer_id`)."""
    transfer_id: int = 0


@dataclass
class _Announced:
    """A read a prefill replica announces in the KV store."""

    transfer_id: int
    prefill: int
    decode: int
    seen: bool = False
    """Whether the prefill replica's grant has reached the front."""
    ended: bool = False
    """Whether the transfer has ended (the decode replica imported it, or gave it up)."""


TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)
"""Upper bounds (seconds) of the transfer-time histogram's buckets."""


@dataclass
class TransferStats:
    """KV moved between replicas, as the front sees it (its counters only grow)."""

    num_transfers: int = 0
    num_failed: int = 0
    num_expired: int = 0
    """Leases that lapsed on a prefill replica with nobody reading them."""
    num_skipped: int = 0
    """Requests that did not hop (short, cached, or their params need the whole run)."""
    bytes: int = 0
    bytes_streamed: int = 0
    """Of `bytes`, those read while the prompt was still being computed."""
    bytes_layered: int = 0
    """Of `bytes_streamed`, those of layers read while the rest of their step still ran."""
    wire_seconds_sum: float = 0.0
    """Time the bytes themselves took (the decode replica's pulls)."""
    seconds_sum: float = 0.0
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(TRANSFER_BUCKETS))
    """Transfers of at most each bound of TRANSFER_BUCKETS (not cumulative); longer ones
    count only in num_transfers."""
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    """The latest transfers' times: from the prefill replica holding the KV to the decode
    replica admitting the request."""

    def observe(self, nbytes: int, seconds: float, wire_seconds: float) -> None:
        self.num_transfers += 1
        self.bytes += nbytes
        self.wire_seconds_sum += wire_seconds
        self.seconds_sum += seconds
        self.recent.append(seconds)
        i = bisect.bisect_left(TRANSFER_BUCKETS, seconds)
        if i < len(self.bucket_counts):
            self.bucket_counts[i] += 1


def _may_hop(params: SamplingParams) -> bool:
    """Whether a request's decode may start from its prompt and first token alone."""
    return (params.max_tokens > 1 and params.structured_outputs is None
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0)


class DisaggEngine(DataParallelEngine):
    """disagg.prefill.replicas + disagg.decode.replicas engines behind Engine's interface."""

    def __init__(self, run: Run, *, progress: bool = True,
                 min_replicas: int | None = None) -> None:
        config = run.config
        d = config.disagg
        assert config.parallel.dp == d.num_replicas, "resolve_layout sets the replicas"
        self.num_prefill = d.prefill.replicas
        self.connector_name = resolve_connector(d.connector)
        self._stream_kv = d.stream_kv and d.prefill.pp == 1
        """Whether prompts' blocks are read as they are computed (a pipeline's steps end
        out of order)."""
        self._store: dist.Store | None = None
        """The KV store (this process serves it, unless launched): the front deletes the
        grants announced there once nobody looks for them."""
        self.kv_run: str | None = None
        """The KV world's name: what its shared-memory files carry."""
        super().__init__(run, progress=False, min_replicas=min_replicas)
        self.disagg = d
        self.prefill_router = Router(config.parallel.router, self.num_prefill,
                                     config.engine.block_size, self._remotes[0].num_blocks)
        self.prefill_router.load = self.router.load  # replicas 0..P-1 are its 0..P-1
        self.decode_trees = {i: PromptTree(config.engine.block_size, r.num_blocks)
                             for i, r in ((r.index, r) for r in self._remotes)
                             if i >= self.num_prefill}
        self._rng = random.Random(0)
        self._hops: dict[str, _Hop] = {}
        self._transfers: dict[str, tuple[int, float]] = {}
        """Requests whose KV a decode replica is reading -> (prefill replica, start)."""
        self._grant_keys: dict[str, _Announced] = {}
        """Reads announced in the KV store: the key goes once the grant reached the front
        and the transfer ended, or once the prefill replica is lost."""
        self._transfer_ids = itertools.count(1)
        self.transfers = TransferStats()
        self._progress = progress
        if progress:
            p, dec = d.prefill, d.decode
            print(f"meshserve: {self.num_prefill} prefill + {self.dp - self.num_prefill} "
                  f"decode replicas ready (prefill tp={p.tp} pp={p.pp}, decode tp={dec.tp} "
                  f"pp={dec.pp}; {'launched' if run.env is not None else 'started here'}; "
                  f"disagg.connector={self.connector_name})", file=sys.stderr, flush=True)

    # --- start-up ------------------------------------------------------------------------

    def _connected(self) -> None:
        if self.run.env is not None:  # launched: every rank reaches the launcher's store
            addr: tuple[str | None, int | None] = (None, None)
            store = own_launched_store(self.run)
        else:
            store = dist.TCPStore("127.0.0.1", 0, self.dp, True, wait_for_workers=False,
                                  timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
            addr = ("127.0.0.1", store.port)
        self._store = store
        self.kv_run = name_run(store)
        for r in self._remotes:
            r.send(KVStoreAt(r.index, self.dp, *addr))

    def _role(self, index: int) -> str:
        return PREFILL if index < self.num_prefill else DECODE

    def _replica_run(self, one: Run, index: int) -> Run:
        """Replica `index` with its phase's tp and pp; on CPU without an explicit thread
        count, the cores shared evenly by every rank of every replica."""
        config = one.config
        phase = config.disagg.phase_of(index)
        new = replace(config, parallel=replace(config.parallel, tp=phase.tp, pp=phase.pp))
        if self.run.config.threads is None and one.device_type == "cpu":
            total = sum(config.disagg.ranks_per_replica)
            new = replace(new, threads=max(1, (os.cpu_count() or 1) // total))
        return one.with_config(new)

    # --- requests ------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate here, then send to a prefill replica (max_tokens=1) or, for a request
        that does not hop, straight to a decode replica."""
        ids, params, request_id, arrival, work = self._admission(prompt, params, request_id,
                                                                 arrival_time)
        stream_id: int | None = None
        stream: StreamTo | None = None
        chain = prompt_chain(ids, self.config.engine.block_size)  # once, for every tree
        while True:  # a replica found lost on the way gets no request
            cached = self._cached_decode(ids, chain)
            hops = (len(ids) >= self.disagg.min_prefill_tokens and _may_hop(params)
                    and cached is None)
            if hops:
                target = self.prefill_router.pick(ids, work, chain)  # counts the work there
                first = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
                if self._stream_kv:  # the decode replica that will read it as it is computed
                    stream_id = stream_id or next(self._transfer_ids)
                    stream = StreamTo(stream_id, self._pick_decode())
                msg: FrontMessage = Prefill(ids, first, request_id, arrival, stream)
            else:
                target = cached if cached is not None else self._pick_decode()
                self.router.load[target] += work
                msg = Add(ids, params, request_id, arrival)
            try:
                self._tell(target, msg)
                break
            except RankFailure as e:
                self.router.done(target, work)
                self._lose(target, str(e))
        if hops:
            self._hops[request_id] = _Hop(ids, params, arrival, target, chain)
        else:
            self.transfers.num_skipped += 1
            self.decode_trees[target].insert(chain)
        self._owner[request_id] = target
        self._prompt_of[request_id] = ids
        self._work_of[request_id] = work
        self.requests_per_replica[target] += 1
        if hops and stream is not None:
            self._stream(request_id, self._hops[request_id], stream)
        return request_id

    def _stream(self, rid: str, hop: _Hop, to: StreamTo) -> None:
        """Have decode replica `decode` read the prompt's blocks as its prefill replica
        computes them: the read counts as begun now (nothing to grant: the blocks are
        listed in the KV store as they are pinned)."""
        hop.decode, hop.streamed, hop.transfer_id = to.decode, True, to.transfer_id
        self._transfers[rid] = (hop.prefill, time.monotonic())
        self._grant_keys[rid] = _Announced(to.transfer_id, hop.prefill, to.decode, seen=True)
        self._tell_or_lose(to.decode, Stream(rid, hop.ids, hop.prefill, to.transfer_id))

    def _cached_decode(self, ids: list[int], chain: list[int]) -> int | None:
        """A live decode replica that already holds most of this prompt, if one does."""
        live = [i for i in self.decode_trees if i in self.router.live]
        if not live:
            raise RankFailure("no decode replica left")
        tree = self.decode_trees[live[0]]
        best = max(live, key=lambda i: self.decode_trees[i].match(chain))
        share = self.decode_trees[best].match(chain) * tree.block_size / max(len(ids), 1)
        return best if share >= CACHE_THRESHOLD else None

    def _pick_decode(self) -> int:
        """The less loaded of two live decode replicas drawn at random. A prompt streamed
        to one counts there from when it was sent to be prefilled (a burst of them would
        all go to one replica otherwise)."""
        live = [i for i in self.decode_trees if i in self.router.live]
        if not live:
            raise RankFailure("no decode replica left")
        pair = self._rng.sample(live, min(2, len(live)))
        bound = dict.fromkeys(pair, 0)
        for rid, hop in self._hops.items():
            if hop.streamed and hop.stage == PREFILL and hop.decode in bound:
                bound[hop.decode] += self._work_of.get(rid, 0)
        return min(pair, key=lambda i: (self.router.load[i] + bound[i], i))

    def _tell(self, index: int, msg: FrontMessage) -> None:
        """Send a message to replica `index`."""
        self._remotes[index].send(msg)

    def _tell_or_lose(self, index: int, msg: FrontMessage) -> None:
        """`_tell`, where a replica found gone is lost (its requests fail or are recomputed)
        rather than the one whose message is being handled."""
        if index in self.down:
            return
        try:
            self._tell(index, msg)
        except RankFailure as e:
            self._lose(index, str(e))

    def abort(self, request_id: str) -> bool:
        """Stop a request on every replica that holds something of it."""
        owner = self._owner.get(request_id)
        if owner is None:
            return False
        hop = self._hops.pop(request_id, None)
        self._done(request_id)
        targets = {owner} | ({hop.prefill} if hop is not None else set()) \
            | ({hop.decode} if hop is not None and hop.decode is not None else set())
        for index in targets:
            if index in self.down:
                continue
            try:
                self._tell(index, Abort(request_id))
            except RankFailure as e:
                self._lose(index, str(e))
        return True

    # --- the replicas' messages ----------------------------------------------------------

    def _on_handoff(self, index: int, msg: HandoffReply) -> list[RequestOutput]:
        hop = self._hops.get(msg.request_id)
        match msg:
            case Held(rid, blocks):
                if hop is None:  # aborted meanwhile: the prefill replica's abort frees it
                    return []
                hop.held_blocks, hop.held_at = list(blocks), time.monotonic()
                if hop.first is not None:  # (else once its output is seen, in `_stitch`)
                    self._import(rid, hop)
            case Granted(rid):
                announced = rid in self._grant_keys
                self._grant_key_step(rid, seen=True)
                if hop is None:  # aborted after the read began: end it, unless the decode
                    if not announced:  # replica may be reading (it reports the end)
                        self._end_transfer(rid)
                    return []
                hop.granted = True  # (the decode replica finds it in the store)
            case ReadDenied(rid, why):
                self._transfers.pop(rid, None)
                self._grant_keys.pop(rid, None)  # (nothing was announced)
                if hop is not None and hop.decode is not None:
                    self._tell_or_lose(hop.decode, ImportCancelled(rid, why))
                    return self._transfer_failed(rid, hop, why)
            case StreamRefused(rid):  # the import comes as for any prompt
                if hop is not None and hop.stage == PREFILL:
                    self._end_transfer(rid)
                    hop.streamed, hop.decode = False, None
                elif hop is None:  # (aborted: its abort's reply ends the read)
                    self._end_transfer(rid)
            case Imported(rid, nbytes, wire_s, admit_s, early_bytes, layered_bytes):
                if rid not in self._transfers and hop is not None:  # nothing was read:
                    self._tell_or_lose(hop.prefill, Abort(rid))  # the lease just goes
                start = self._end_transfer(rid)
                if nbytes and start is not None and hop is not None:
                    # held -> import sent here, then import -> admitted there: not when
                    # this loop, busy with a prefill step, got around to reading the reply
                    self.transfers.observe(nbytes, hop.import_sent_at - start + admit_s,
                                           wire_s)
                    self.transfers.bytes_streamed += early_bytes
                    self.transfers.bytes_layered += layered_bytes
                if hop is not None:
                    hop.stage = "decode"
            case ImportFailed(rid, why):
                self._end_transfer(rid)
                if hop is not None and hop.stage != "decode":  # (else already failed over)
                    return self._transfer_failed(rid, hop, why)
            case LeaseLapsed():
                self.transfers.num_expired += 1
        return []

    def _import(self, rid: str, hop: _Hop) -> None:
        """The prompt's KV is held and its first token known: send it to a decode replica.

        The lease's read begins now and the decode replica pulls as soon as it has its
        blocks, with no ask and no grant through this loop: the prefill replica is told to
        export and announces its grant in the KV store, where the decode replica looks (a
        refusal still comes through here)."""
        assert hop.first is not None and hop.held_blocks is not None
        streamed = hop.streamed and rid in self._grant_keys  # (its decode replica is live)
        target = hop.decode if streamed and hop.decode is not None else self._pick_decode()
        self._move(rid, hop.prefill, target, hop.chain)
        hop.decode, hop.stage = target, "held"
        transfer_id = hop.transfer_id if streamed else next(self._transfer_ids)
        if streamed:  # the grant of the rest is still to come
            self._grant_keys[rid].seen = False
        else:
            self._grant_keys[rid] = _Announced(transfer_id, hop.prefill, target)
        self._transfers[rid] = (hop.prefill, hop.held_at)
        self._tell_or_lose(hop.prefill, Export(rid, transfer_id))
        if hop.prefill in self.down:  # lost on the way: the hop failed over
            return
        hop.stage = "import"
        hop.import_sent_at = time.monotonic()
        self._tell_or_lose(target, Import(rid, hop.ids + hop.first.token_ids,
                                          decode_params(hop.params), hop.arrival, hop.prefill,
                                          hop.held_blocks, transfer_id, hop.granted))

    def _grant_key_step(self, rid: str, *, seen: bool = False, ended: bool = False) -> None:
        """A read announced in the KV store: its grant was seen here, or its transfer
        ended. Once both, nobody will look for the key again: it goes."""
        read = self._grant_keys.get(rid)
        if read is None:
            return
        read.seen, read.ended = read.seen or seen, read.ended or ended
        if read.seen and read.ended:
            del self._grant_keys[rid]
            self._forget_grant(read.transfer_id)

    def _forget_grant(self, transfer_id: int) -> None:
        if self._store is not None:
            forget_grant(self._store, transfer_id)

    def _end_transfer(self, rid: str) -> float | None:
        """A decode replica is done reading `rid`'s KV: the prefill replica unpins it."""
        entry = self._transfers.pop(rid, None)
        if entry is None:
            return None
        self._grant_key_step(rid, ended=True)
        prefill, start = entry
        if prefill not in self.down:
            try:
                self._tell(prefill, ReadDone(rid))
            except RankFailure as e:
                self._lose(prefill, str(e))
        return start

    def _transfer_failed(self, rid: str, hop: _Hop, why: str) -> list[RequestOutput]:
        self.transfers.num_failed += 1
        assert hop.decode is not None and hop.first is not None
        if self.disagg.on_failure == "recompute":
            hop.stage = "decode"
            self._tell_or_lose(hop.decode, Add(hop.ids + hop.first.token_ids,
                                               decode_params(hop.params), rid, hop.arrival))
            return []
        return [RequestOutput(rid, hop.ids, finished=True, finish_reason="error",  # (after
                              metrics=hop.first.metrics, replica=hop.decode,  # the first token)
                              error=f"the KV of request {rid!r} could not be moved from "
                                    f"prefill replica {hop.prefill} to decode replica "
                                    f"{hop.decode}: {why}")]

    def _move(self, rid: str, src: int, dst: int, chain: list[int]) -> None:
        """The request's work moves from replica `src` to `dst`."""
        work = self._work_of[rid]
        self.router.done(src, work)
        self.router.load[dst] += work
        self._owner[rid] = dst
        self.decode_trees[dst].insert(chain)

    # --- stepping ------------------------------------------------------------------------

    def _returned(self, out: RequestOutput) -> RequestOutput | None:
        """`out` stitched (see `_stitch`); a finished request is done here."""
        merged = self._stitch(out)
        if merged is not None and merged.finished and merged.request_id in self._owner:
            self._hops.pop(merged.request_id, None)
            self._done(merged.request_id)
        return merged

    def _busy_remotes(self) -> list[Any]:
        reading = {p for p, _ in self._transfers.values()}  # prefill replicas still read from
        for read in self._grant_keys.values():  # replies still due on announced reads
            reading |= ({read.decode} if not read.ended else set()) \
                | ({read.prefill} if not read.seen else set())
        return [r for r in self._live_remotes()
                if self.router.load[r.index] > 0 or r.index in reading]

    def _stitch(self, out: RequestOutput) -> RequestOutput | None:
        """`out` as the user sees it: the first token from the prefill replica, the rest
        from the decode replica; None for outputs of requests no longer here."""
        rid = out.request_id
        if rid not in self._owner:
            return None
        hop = self._hops.get(rid)
        if hop is None:  # never hopped
            out.replica = self._owner[rid]
            return out
        if out.replica == hop.prefill and hop.first is None:
            if out.finished and out.finish_reason == "length":
                hop.first = out
                if hop.held_blocks is not None:
                    self._import(rid, hop)
                return replace(out, finished=False, finish_reason=None)
            if hop.streamed and hop.decode is not None:  # its blocks are read no more
                self._tell_or_lose(hop.decode, Abort(rid))
            return out  # stopped at its first token (or failed): the end of it
        if hop.first is None or out.replica != hop.decode:
            return None
        first = hop.first
        metrics = replace(out.metrics, arrival_time=first.metrics.arrival_time,
                          first_scheduled_time=first.metrics.first_scheduled_time,
                          first_token_time=first.metrics.first_token_time,
                          num_prompt_tokens=first.metrics.num_prompt_tokens,
                          num_cached_tokens=first.metrics.num_cached_tokens,
                          num_generated_tokens=out.metrics.num_generated_tokens + 1)
        logprobs = None
        if out.logprobs is not None and first.logprobs is not None:
            logprobs = first.logprobs + out.logprobs
        return replace(out, prompt_token_ids=hop.ids,
                       token_ids=first.token_ids + out.token_ids, text=first.text + out.text,
                       logprobs=logprobs, prompt_logprobs=first.prompt_logprobs,
                       metrics=metrics)

    def _lose(self, index: int, reason: str) -> None:
        if index < self.num_prefill:
            self.prefill_router.drop(index)
        for rid, (prefill, _start) in list(self._transfers.items()):
            hop = self._hops.get(rid)
            if hop is not None and hop.decode == index:  # nobody will read it now
                self._end_transfer(rid)
            elif prefill == index:
                self._transfers.pop(rid)
        for rid, read in list(self._grant_keys.items()):
            if read.decode == index:  # (its request may be gone: aborted)
                self._end_transfer(rid)
            if read.prefill == index:  # it announces nothing more; what it did, goes
                self._grant_keys.pop(rid, None)
                self._forget_grant(read.transfer_id)
        for rid, hop in list(self._hops.items()):  # prompts read as they are computed
            if not hop.streamed or hop.stage != PREFILL:
                continue
            if hop.decode == index:  # another decode replica imports it when it is done
                hop.streamed, hop.decode = False, None
            elif hop.prefill == index and hop.decode is not None:
                self._tell_or_lose(hop.decode, ImportCancelled(rid, f"prefill replica "
                                                                f"{index} was lost"))
        super()._lose(index, reason)
        for rid in [rid for rid in self._hops if rid not in self._owner]:
            del self._hops[rid]
        # KV held on a lost prefill replica that nobody began reading will never move: the
        # decode replica frees what it allocated, and the request fails or is recomputed
        # (a read already granted fails on its own, bounded by disagg.transfer_timeout_s).
        for rid, hop in list(self._hops.items()):
            if hop.prefill == index and hop.decode is not None and not hop.granted \
                    and hop.stage in ("held", "import") and hop.decode not in self.down:
                self._buffered += self._on_handoff(index, ReadDenied(rid, self._gone(index)))

    def _gone(self, index: int) -> str:
        return f"prefill replica {index} was lost ({self.down.get(index, 'down')})"

    def shutdown(self) -> None:
        """Stop every replica, then this side's connector and the KV store."""
        t = getattr(self, "transfers", None)
        if getattr(self, "_progress", False) and t is not None and t.num_transfers + \
                t.num_failed + t.num_skipped:
            print(f"meshserve: KV of {t.num_transfers} requests moved from prefill to decode "
                  f"replicas ({t.bytes} bytes), {t.num_failed} failed, {t.num_skipped} "
                  "prefilled on their decode replica", file=sys.stderr, flush=True)
            self._progress = False
        super().shutdown()
        self._store = None
        kv_run = getattr(self, "kv_run", None)
        if kv_run is not None:  # what dead ranks left behind
            sweep_run(kv_run)
            self.kv_run = None
