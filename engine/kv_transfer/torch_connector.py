"""The torch connector: the decode rank asks each source rank for its piece through the
KV store, and a thread of the source rank answers, a layer at a time, through shared
memory on one host or a torch.distributed wire (engine/kv_transfer/connector.py has the
whole picture)."""

from __future__ import annotations

import itertools
import json
import math
import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import numpy as np
import torch
import torch.distributed as dist

from meshserve.engine.config.disagg_config import TORCH_WIRES
from meshserve.engine.kv_transfer.blocks import KVCache
from meshserve.engine.kv_transfer.connector import KVConnector
from meshserve.engine.kv_transfer.pair_groups import PairGroups, nccl_usable
from meshserve.engine.kv_transfer.peers import (
    KV_STARTUP_S,
    RUN_KEY,
    KVPeers,
    shm_prefix,
)
from meshserve.engine.kv_transfer.pieces import (
    Piece,
    RankKV,
    block_index,
    by_layer,
    layer_shape,
    pack_layer,
    pieces_from,
    unpack_layer,
)
from meshserve.engine.kv_transfer.shm_channel import ChannelError, ShmChannel
from meshserve.parallel.comm.shm_allreduce import supported
from meshserve.parallel.comm.shm_names import SHM_DIR


class TorchKVConnector(KVConnector):
    """The decode rank asks each source rank for its piece through the KV store; a thread
    of the source rank answers every ask, a layer at a time: through the two ranks'
    channel in shared memory on one host, else torch.distributed point-to-point (`wire`):
    `gloo`, tagged messages over one gloo group of every replica's ranks (a GPU cache
    staged through host memory); `nccl`, a group per pair of ranks (parallel/comm/
    pair_groups.py) carrying each layer from one GPU's cache to the other's, matched in the
    order both sides issue them (an ask's layers in turn, the asks to one rank in the
    order they are numbered); `gloo_pairs`, the same pairs and order over gloo."""

    name = "torch"

    def __init__(self, me: RankKV, replica: int, cache: KVCache, peers: KVPeers,
                 timeout_s: float, shm: bool = True, wire: str = "auto") -> None:
        super().__init__(me, replica, cache, peers, timeout_s)
        if peers.open_store is None:
            raise ValueError("the torch connector answers asks on a store connection of "
                             "its own: KVPeers needs open_store")
        self.wire = resolve_wire(wire, cache)
        self._device = cache[0][0].device
        self._side: torch.cuda.Stream | None = None
        """NCCL: the stream this rank packs and places on, so the model's work queued on
        the default stream does not hold them up (what is read was listed once its CUDA
        event had passed; what is written is used once the pull has returned)."""
        if self.wire == "nccl":  # GPU to GPU, over NVLink on one host too
            shm = False
            self._side = torch.cuda.Stream(self._device)
        self._timeout = timedelta(seconds=timeout_s)
        self._prefix: str | None = None
        """Where this run's shared-memory files are named (None: no shared memory)."""
        self._local: dict[int, bool] = {}
        self._channels: dict[tuple[int, int], ShmChannel] = {}
        """(source rank, destination rank) -> the channel between them, made on first use."""
        self._making: dict[tuple[int, int], threading.Lock] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._asked = itertools.count(1)
        if shm and supported() and shutil.disk_usage(SHM_DIR).free >= (
                peers.world - 1) * ShmChannel.footprint():
            # A rank leaves a marker in shared memory (if there is room for a channel with
            # every other rank) before the group below forms, so once it has, each rank
            # tells the ranks it shares memory with by their markers; one without room
            # leaves none and uses gloo with everyone, who then use gloo with it.
            with peers.lock:
                peers.store.wait([RUN_KEY], timedelta(seconds=KV_STARTUP_S))
                token = peers.store.get(RUN_KEY).decode()
            self._prefix = f"{SHM_DIR}/{shm_prefix(token)}"
            with open(self._marker(me.rank), "w") as f:
                f.write(str(os.getpid()))
        self._agree_on_wire()
        # Its rendezvous waits for every rank to load; each send and recv below is
        # bounded by disagg.transfer_timeout_s instead.
        self.group: dist.ProcessGroup | None = cast(dist.ProcessGroup, dist.ProcessGroupGloo(
            dist.PrefixStore("meshserve-kv", peers.store), me.rank, peers.world,
            timedelta(seconds=KV_STARTUP_S))) if self.wire == "gloo" else None
        self.pairs = None if self.wire == "gloo" else PairGroups(
            peers.open_store, me.rank, "nccl" if self.wire == "nccl" else "gloo", timeout_s)
        self._in_order: dict[int, queue.SimpleQueue[bytes]] = {}
        """Asker rank -> its asks not yet answered, answered in turn by a thread of their
        own (pairs only: that pair's messages go in the order they were asked for)."""
        answers = peers.open_store()
        try:
            answers.queue_len(_asks_key(me.rank))
        except NotImplementedError:
            raise ValueError("disagg.connector=torch: the KV store has no queues (a "
                             "TCPStore without libuv, as USE_LIBUV=0 makes); unset "
                             "USE_LIBUV or use disagg.connector=nixl") from None
        self._answering = threading.Thread(target=self._answer, args=(answers,),
                                           name="meshserve-kv-answer", daemon=True)
        self._answering.start()

    def _agree_on_wire(self) -> None:
        """Every rank of the KV world must use the same wire (auto may resolve differently
        where some ranks see no GPU): an error naming them, not a group that never forms."""
        keys = [f"meshserve-kv/wire/{r}" for r in range(self.peers.world)]
        gpu = ""
        if self.wire == "nccl":  # which GPU: NCCL takes one a rank
            gpu = str(getattr(torch.cuda.get_device_properties(self._device), "uuid", ""))
        with self.peers.lock:
            self.peers.store.set(keys[self.me.rank], json.dumps([self.wire, gpu]))
            self.peers.store.wait(keys, timedelta(seconds=KV_STARTUP_S))
            found = [json.loads(self.peers.store.get(k)) for k in keys]
        wires = [w for w, _ in found]
        if any(w != self.wire for w in wires):
            raise ValueError("disagg.torch_wire: the ranks of the KV world resolved it to "
                             + ", ".join(f"rank {r}: {w}" for r, w in enumerate(wires))
                             + "; allowed: one wire on every rank (set disagg.torch_wire "
                             "to gloo, or to nccl where every rank has a GPU)")
        gpus = [g for _, g in found]
        shared = [r for r, g in enumerate(gpus) if g and gpus.count(g) > 1]
        if shared:
            raise ValueError(f"disagg.torch_wire=nccl: ranks {shared} share a GPU, and NCCL "
                             "takes one GPU a rank; allowed there: gloo")

    def _marker(self, rank: int) -> str:
        return f"{self._prefix}rank{rank}"

    def _shares_memory(self, rank: int) -> bool:
        """Whether global rank `rank` runs where this rank's shared memory is its too."""
        if self._prefix is None:
            return False
        if rank not in self._local:
            self._local[rank] = os.path.exists(self._marker(rank))
        return self._local[rank]

    def _channel(self, src: int, dst: int, deadline: float, what: str) -> ShmChannel:
        """The channel from rank `src` to rank `dst`: this rank's end (the receiver makes
        the segment; the sender waits for it)."""
        key = (src, dst)
        path = f"{self._prefix}{src}-{dst}"
        with self._lock:
            if key in self._channels:
                return self._channels[key]
            if dst == self.me.rank:
                self._channels[key] = ShmChannel.receiver(path)
                return self._channels[key]
            making = self._making.setdefault(key, threading.Lock())
        # One sender maps it, while the others for the same rank wait (the receiver removes
        # the name once one has): not under the connector's lock, so other pairs go on.
        if not making.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ChannelError(f"{what}: the channel to rank {dst} was not mapped in time")
        try:
            with self._lock:
                if key in self._channels:
                    return self._channels[key]
            made = ShmChannel.sender(path, deadline, what)
            with self._lock:
                self._channels[key] = made
            return made
        finally:
            making.release()

    def _sizes(self, piece: Piece, num_blocks: int) -> list[int]:
        """The bytes of each of a piece's layers over `num_blocks` blocks."""
        shape = layer_shape(self.cache, piece, num_blocks)
        return [math.prod(shape) * self.cache[0][0].element_size()] * piece.num_layers

    # --- the decode side -----------------------------------------------------------------

    def pull(self, src: int, transfer_id: int, src_blocks: Sequence[int],
             dst_blocks: Sequence[int], layers: tuple[int, int] | None = None) -> int:
        """Ask for every piece, post every layer's receive at once, and write each layer
        into the cache as it lands, while the later ones are still on the wire (or being
        packed)."""
        whole = self._incoming(src)
        # A piece is named to its source by its place among the whole pieces from there.
        named = [(p.within(layers) if layers else p, p) for p in whole]
        asked = [(p, w) for p, w in named if p is not None]
        idx = block_index(self.cache, dst_blocks)
        deadline = time.monotonic() + self.timeout_s
        stream = self._side
        landing: list[_Landing] = []
        placed = False
        try:
            local = [(p, w) for p, w in asked if self._shares_memory(p.src.rank)]
            remote = [(p, w) for p, w in asked if not self._shares_memory(p.src.rank)]
            with self._on(stream):
                if self.pairs is None:
                    landing = self._post_tagged(remote, whole, transfer_id, src_blocks,
                                                len(idx))
                else:  # (into `landing` as it goes: what was posted before a failure too)
                    self._post_pairs(remote, whole, transfer_id, src_blocks, len(idx),
                                     deadline, landing)
            asks = {id(p): self._ask(w, whole, transfer_id, src_blocks, p.layers)
                    for p, w in local}
            n = _each(lambda p: self._pull_local(p, asks[id(p)], idx, deadline),
                      [p for p, _ in local])
            for land in landing:
                with self._on(stream):  # (NCCL: the stream waits for the layer to land)
                    self._wait(land.work, deadline)
                    land.done = True
                    unpack_layer(self.cache, self.me, land.piece, idx, land.layer, land.buf)
            placed = True
        except (RuntimeError, OSError) as e:
            raise RuntimeError(f"receiving {len(dst_blocks)} KV blocks from replica {src} "
                               f"failed or took over disagg.transfer_timeout_s="
                               f"{self.timeout_s} s (torch connector, {self.wire}): {e}"
                               ) from None
        finally:
            if not placed and self.pairs is not None:
                self._settle(landing, deadline)
            if stream is not None:  # in the cache (or done writing) before the blocks
                stream.synchronize()  # are read or freed
        n += sum(land.buf.numel() * land.buf.element_size() for land in landing)
        self.bytes_moved += n
        return n

    def _post_tagged(self, named: list[tuple[Piece, Piece]], whole: list[Piece],
                     transfer_id: int, src_blocks: Sequence[int],
                     num_blocks: int) -> list[_Landing]:
        """The one gloo group: ask for every piece, then post every layer's receive under
        its own tag (the layers of all pieces interleaved, first layers first)."""
        assert self.group is not None
        asks = {id(p): self._ask(w, whole, transfer_id, src_blocks, p.layers)
                for p, w in named}
        out = []
        for p, layer in by_layer([p for p, _ in named]):
            b = self._landing(p, num_blocks)
            out.append(_Landing(p, layer, b, self.group.recv([b], p.src.rank,
                                                             _tag(asks[id(p)], layer))))
        return out

    def _post_pairs(self, named: list[tuple[Piece, Piece]], whole: list[Piece],
                    transfer_id: int, src_blocks: Sequence[int], num_blocks: int,
                    deadline: float, out: list[_Landing]) -> None:
        """Pair groups: each piece's ask and its layers' receives are issued together, in
        the order the source answers them (asks to one rank in the order they are
        numbered, an ask's layers in turn), into `out`. A pair whose issuing fails
        half-way (an ask without its receives) is retired."""
        assert self.pairs is not None
        for p, w in named:
            src = p.src.rank
            # (allocated before the ask: a pair is never left with an ask half received)
            bufs = [self._landing(p, num_blocks) for _ in range(p.num_layers)]
            with self.pairs.issuing(src, self.me.rank, deadline):
                gen = self.pairs.generation(src, self.me.rank)
                try:
                    self._ask(w, whole, transfer_id, src_blocks, p.layers, gen)
                    group = self.pairs.group(src, self.me.rank, gen)
                    for layer, b in enumerate(bufs):
                        out.append(_Landing(p, layer, b, group.recv([b], 0, 0), gen))
                except BaseException:
                    self.pairs.retire(src, self.me.rank, gen)
                    raise

    def _settle(self, landing: list[_Landing], deadline: float) -> None:
        """A pull that failed: a pair that failed, or whose receives are still posted when
        the deadline has passed, may hold a stray message and is never used again; the
        other pairs' layers are let land first (their answers are on the way)."""
        assert self.pairs is not None
        # A pair's layers come in order, so the one that failed is the first of its pair
        # not done, and fails again at once; the pair's later layers are not waited for.
        failed: set[tuple[int, int]] = set()
        for land in landing:
            key = (land.piece.src.rank, land.gen)
            if land.done or key in failed:
                continue
            try:
                self.pairs.wait(land.work, deadline)
                land.done = True
            except RuntimeError:
                failed.add(key)
        for src_rank, gen in {(land.piece.src.rank, land.gen) for land in landing
                              if not land.done}:
            self.pairs.retire(src_rank, self.me.rank, gen)

    def _landing(self, p: Piece, num_blocks: int) -> torch.Tensor:
        """Where one layer of `p` lands: on the cache's GPU over NCCL, else host memory."""
        device = self._device if self.wire == "nccl" else torch.device("cpu")
        return torch.empty(layer_shape(self.cache, p, num_blocks),
                           dtype=self.cache[0][0].dtype, device=device)

    def _wait(self, work: dist.Work, deadline: float) -> None:
        if self.pairs is not None:
            self.pairs.wait(work, deadline)
        else:
            work.wait(self._timeout)

    def _on(self, stream: torch.cuda.Stream | None) -> AbstractContextManager[object]:
        return nullcontext() if stream is None else torch.cuda.stream(stream)

    def _ask(self, piece: Piece, pieces: list[Piece], transfer_id: int,
             blocks: Sequence[int], layers: tuple[int, int], gen: int = 0) -> int:
        """Ask `piece`'s source rank for its global `layers` over `blocks`; the ask's
        number, which names its channel transfer and its point-to-point tags (unique
        between the two ranks: this rank numbers its own asks); `gen`: the generation of
        the pair group it is answered on."""
        n = next(self._asked)
        k = [p for p in pieces if p.src.rank == piece.src.rank].index(piece)
        ask = np.array([self.me.rank, n, transfer_id, k, *layers, gen, *blocks],
                       dtype=np.int64)
        with self.peers.lock:
            self.peers.store.queue_push(_asks_key(piece.src.rank), ask.tobytes())
        return n

    def _pull_local(self, p: Piece, ask: int, idx: torch.Tensor, deadline: float) -> int:
        sizes = self._sizes(p, len(idx))
        if not sum(sizes):
            return 0
        what = f"KV transfer {ask} from rank {p.src.rank}"
        partial: dict[int, torch.Tensor] = {}

        def place(layer: int, start: int, chunk: torch.Tensor) -> None:
            if chunk.numel() == sizes[layer]:  # the whole layer: placed straight from it
                unpack_layer(self.cache, self.me, p, idx, layer,
                             _as_layer(chunk, self.cache, p, len(idx)))
                return
            buf = partial.setdefault(layer, torch.empty(sizes[layer], dtype=torch.uint8))
            buf[start:start + chunk.numel()].copy_(chunk)
            if start + chunk.numel() == sizes[layer]:
                unpack_layer(self.cache, self.me, p, idx, layer,
                             _as_layer(partial.pop(layer), self.cache, p, len(idx)))

        self._channel(p.src.rank, self.me.rank, deadline, what).receive(
            ask, sizes, deadline, what, place)
        return sum(sizes)

    # --- the prefill side ----------------------------------------------------------------

    def _answer(self, store: dist.Store) -> None:
        """Answer this rank's asks as they come, each in a thread of its own (a stuck one
        holds up no other), until `close` (or the store is gone)."""
        store.set_timeout(timedelta(seconds=ASK_WAIT_S))
        try:
            self._take_asks(store)
        finally:
            for asks in self._in_order.values():
                asks.put(_STOP)

    def _take_asks(self, store: dist.Store) -> None:
        while True:
            try:
                ask = store.queue_pop(_asks_key(self.me.rank))
            except RuntimeError as e:
                if self._closing or "timeout" not in str(e).lower():
                    return
                continue
            if ask == _STOP:
                return
            asker = int(np.frombuffer(ask, dtype=np.int64)[0])
            if self.pairs is None or self._shares_memory(asker):
                threading.Thread(target=self._answer_one, args=(ask,),
                                 name="meshserve-kv-answer-one", daemon=True).start()
                continue
            if asker not in self._in_order:
                self._in_order[asker] = queue.SimpleQueue()
                threading.Thread(target=self._answer_in_order, args=(self._in_order[asker],),
                                 name="meshserve-kv-answer-pair", daemon=True).start()
            self._in_order[asker].put(ask)

    def _answer_in_order(self, asks: queue.SimpleQueue[bytes]) -> None:
        """One asker's asks over its pair group, one after another, as they were asked."""
        while (ask := asks.get()) != _STOP and not self._closing:
            self._answer_one(ask)

    def _answer_one(self, ask: bytes) -> None:
        asker, n, transfer_id, k, lo, hi, gen, *blocks = np.frombuffer(
            ask, dtype=np.int64).tolist()
        deadline = time.monotonic() + self.timeout_s
        pairs = None if self._shares_memory(asker) else self.pairs  # (None: no pair group)
        if pairs is not None and not pairs.adopt(self.me.rank, asker, gen):
            print(f"meshserve: KV transfer {transfer_id} from rank {self.me.rank} to rank "
                  f"{asker} dropped: asked on a retired pair group (generation {gen})",
                  file=sys.stderr, flush=True)
            return
        try:
            dests = self.peers.ranks(self.peers.replica_of(asker))
            mine = [p for p in pieces_from(self.me, self.peers.ranks(self.replica), dests)
                    if p.dst.rank == asker]
            piece = mine[k].within((lo, hi))
            assert piece is not None, (mine[k], lo, hi)  # (the asker asks for none empty)
            nbytes = self._send_piece(piece, n, gen, block_index(self.cache, blocks),
                                      deadline)
        except Exception as e:  # noqa: BLE001 - the asker fails on its side, naming this replica
            if pairs is not None:  # its receives may be left posted: the pair starts afresh
                pairs.retire(self.me.rank, asker, gen)
            if self._closing:  # (cut short by `close`)
                return
            print(f"meshserve: KV transfer {transfer_id} from rank {self.me.rank} to rank "
                  f"{asker} failed (torch connector, {self.wire}): {e}", file=sys.stderr,
                  flush=True)
            return
        with self._lock:
            self.bytes_moved += nbytes

    def _send_piece(self, p: Piece, ask: int, gen: int, idx: torch.Tensor,
                    deadline: float) -> int:
        """A piece a layer at a time: a layer goes on the wire as soon as it is packed
        (staged to host memory from a GPU, but for NCCL), while the next one is packed;
        into a shared channel it is packed straight."""
        if self._shares_memory(p.dst.rank):
            return self._send_local(p, ask, idx, deadline)
        sent = []
        with self._on(self._side):
            if self.pairs is not None:
                group = self.pairs.group(self.me.rank, p.dst.rank, gen)
            for _, layer in by_layer([p]):
                buf = pack_layer(self.cache, self.me, p, idx, layer)
                buf = buf if self.wire == "nccl" else buf.cpu()
                if self.pairs is None:
                    assert self.group is not None
                    sent.append((self.group.send([buf], p.dst.rank, _tag(ask, layer)), buf))
                else:
                    sent.append((group.send([buf], 1, 0), buf))
        for work, _ in sent:
            self._wait(work, deadline)
        return sum(b.numel() * b.element_size() for _, b in sent)

    def _send_local(self, p: Piece, ask: int, idx: torch.Tensor, deadline: float) -> int:
        sizes = self._sizes(p, len(idx))
        if not sum(sizes):
            return 0
        what = f"KV transfer {ask} to rank {p.dst.rank}"
        packed: dict[int, torch.Tensor] = {}

        def fill(layer: int, start: int, slot: torch.Tensor) -> None:
            if slot.numel() == sizes[layer]:  # the whole layer: packed straight into it
                pack_layer(self.cache, self.me, p, idx, layer,
                           out=_as_layer(slot, self.cache, p, len(idx)))
                return
            if layer not in packed:
                packed.clear()
                packed[layer] = pack_layer(self.cache, self.me, p, idx, layer).cpu().view(
                    -1).view(torch.uint8)
            slot.copy_(packed[layer][start:start + slot.numel()])

        self._channel(self.me.rank, p.dst.rank, deadline, what).send(
            ask, sizes, deadline, what, fill)
        return sum(sizes)

    def close(self) -> None:
        self._closing = True
        try:  # the answering thread's last ask
            with self.peers.lock:
                self.peers.store.queue_push(_asks_key(self.me.rank), _STOP)
        except RuntimeError:
            pass  # the store is gone: so is its wait
        # Joined, so it is not inside the store's client as the process ends (a thread
        # unwound there at exit aborts the process).
        self._answering.join(timeout=CLOSE_WAIT_S)
        if self.pairs is not None:
            self.pairs.close()
        with self._lock:
            for channel in self._channels.values():
                channel.unlink()  # (a receiver's, if its sender never came)
                channel.close()
            self._channels.clear()
        if self._prefix is not None:
            try:
                os.unlink(self._marker(self.me.rank))
            except FileNotFoundError:
                pass


ASK_WAIT_S = 3600.0
"""How long a torch connector's answering thread waits on the store at a time (its
`close` wakes it)."""

CLOSE_WAIT_S = 5.0
"""Longest `close` waits for the answering thread to take its last ask."""

_STOP = b"stop"


def _asks_key(rank: int) -> str:
    """The queue, in the KV store, of the asks to global rank `rank`."""
    return f"meshserve-kv/asks/{rank}"


@dataclass
class _Landing:
    """One layer of a piece on its way in: its receive and the buffer it lands in."""

    piece: Piece
    layer: int
    buf: torch.Tensor
    work: dist.Work
    gen: int = 0
    """The generation of the pair group it comes over (pair groups only)."""
    done: bool = False


def resolve_wire(wire: str, cache: KVCache) -> str:
    """`disagg.torch_wire` with auto resolved: gloo_pairs (on loopback about twice as fast
    as the tagged group from 33 MB a pull up, and it starts afresh after a failed
    transfer; nccl, not yet run on GPUs, is asked for by name)."""
    on_gpu = cache[0][0].device.type == "cuda"
    if wire == "auto":
        return "gloo_pairs"
    if wire not in TORCH_WIRES:
        raise ValueError(f"disagg.torch_wire={wire!r}: allowed: {TORCH_WIRES}")
    if wire == "nccl" and not (on_gpu and nccl_usable()):
        raise ValueError(f"disagg.torch_wire=nccl: the KV cache is on {cache[0][0].device} "
                         "or this torch has no NCCL; allowed here: auto, gloo, gloo_pairs")
    return wire


def _each(move: Callable[[Piece], int], pieces: list[Piece]) -> int:
    """`move` every piece, each with a channel of its own, at once (a transfer stuck on one
    pair of ranks then holds up no other pair); the bytes moved. Raises the first error."""
    if len(pieces) <= 1:
        return sum(move(p) for p in pieces)
    with ThreadPoolExecutor(len(pieces), thread_name_prefix="meshserve-kv-piece") as pool:
        return sum(f.result() for f in [pool.submit(move, p) for p in pieces])


def _as_layer(part: torch.Tensor, cache: KVCache, piece: Piece, num_blocks: int) -> torch.Tensor:
    """Bytes of shared memory as one packed layer of `piece`."""
    return part.view(cache[0][0].dtype).view(layer_shape(cache, piece, num_blocks))


MAX_LAYERS = 1 << 10
"""Layers a piece may have: a transfer's layer l travels under its own tag."""


def _tag(transfer_id: int, layer: int) -> int:
    """The point-to-point tag of one layer of one transfer (within gloo's 32 bits)."""
    return (transfer_id * MAX_LAYERS + layer) % (1 << 31)
