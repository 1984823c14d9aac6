"""A streamed prompt's KV, listed as its prefill replica computes it, the last step layer
by layer.

A prefill replica pins the blocks a step will complete of each streamed prompt as the step
is scheduled (`StreamLister.launched`) and lists them "full" once the step's last layer
has run (`StreamLister.layer_done`). The step that ends a prompt (its first token comes
next) lists them after each layer too, with the count of layers written so far: the
decode replica reads those layers while the later ones are computed, so the prompt's KV
is mostly across by the time its first token is out. Earlier steps list only at their
end: the steps after them leave time to read, and each read costs the decode replica's
cores a little whatever its size.

On a CPU the forward calls back after each layer has run. On a GPU the call comes as the
layer is enqueued: it records an event, and a thread of the lister lists the layer once
the event has completed.

A step's forward runs (or is enqueued, on a GPU) on the thread that scheduled it, right
after `launched`, so the hook's calls belong to the step launched last. A step whose
forward never reaches the hook's last layer (a step of one-token chunks runs through a
fused decoder or a CUDA graph, which call no hook) is listed as the next one is launched:
its forward has run (or been enqueued) by then. A forward whose token count differs from
the launched step's stops the layer-by-layer listing (the hook is ignored from then on),
and every step is then listed as the next one is launched.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

LIST_EVERY_S = 0.002
"""Within a step, how often at most a prefill replica lists newly written layers (the
step's last layer is always listed at once)."""


@dataclass(frozen=True)
class Listed:
    """What a prefill replica lists of one streamed prompt: the blocks pinned for it, of
    which the first `full` hold every layer and the rest layers [0, `layers`)."""

    blocks: list[int]
    full: int
    layers: int

    def to_json(self) -> list[int]:
        return [self.full, self.layers, *self.blocks]

    @classmethod
    def from_json(cls, value: list[int]) -> Listed:
        full, layers, *blocks = value
        return cls(blocks, full, layers)

    def layers_of(self, index: int, num_layers: int) -> int:
        """How many layers the prompt's `index`-th block holds, as listed."""
        if index < self.full:
            return num_layers
        return self.layers if index < len(self.blocks) else 0


Move = tuple[int, int, int, int]
"""(start, stop, lo, hi): layers [lo, hi) of a run of blocks [start, stop)."""


def moves(have: list[int], want: list[int]) -> list[Move]:
    """The reads that bring every block i from `have[i]` layers to `want[i]`: consecutive
    blocks that lack the same layers are read together."""
    out: list[Move] = []
    for i, (h, w) in enumerate(zip(have, want, strict=True)):
        if w <= h:
            continue
        if out and out[-1][1] == i and out[-1][2:] == (h, w):
            out[-1] = (out[-1][0], i + 1, h, w)
        else:
            out.append((i, i + 1, h, w))
    return out


@dataclass
class Stream:
    """A prompt prefilled here whose blocks its decode replica reads as they are computed."""

    transfer_id: int
    decode: int
    """The decode replica reading it."""
    pinned: list[int] = field(default_factory=list)
    """The blocks pinned for it so far (until the read is done), in prompt order."""
    full: int = 0
    """How many of `pinned` hold every layer."""
    partial: int = 0
    """pinned[full:partial] hold layers [0, layers)."""
    layers: int = 0
    open: bool = True
    """Whether its prompt is still being computed here (and was never preempted: its
    blocks may change then, so the rest moves after the first token)."""

    def listed(self) -> Listed:
        end = self.partial if self.layers else self.full
        return Listed(self.pinned[:end], self.full, self.layers)


@dataclass
class _Step:
    """A step scheduled: its token count and, by request, how many of the blocks pinned
    it completes, and whether it ends the prompt (listed layer by layer)."""

    num_tokens: int
    ends: dict[str, tuple[int, bool]]
    layered: bool
    """Whether any of `ends` is listed layer by layer."""


Publish = Callable[[int, dict[int, Listed]], None]
"""publish(decode replica, what is listed there by transfer id)."""


class StreamLister:
    """A prefill replica's streamed prompts and what it lists of them. Every call comes on
    the replica's main thread (the forward's too); on a GPU a thread of the lister's own
    lists each layer once its event has completed, so their state is under a lock."""

    def __init__(self, layers: tuple[int, int], publish: Publish, cuda: bool) -> None:
        self.first, self.last = layers[0], layers[1] - 1
        self._publish = publish
        self.streams: dict[str, Stream] = {}
        self.lock = threading.Lock()
        self._publishing = threading.Lock()
        self._running: _Step | None = None
        """The step launched last, until its forward's last layer."""
        self._layerwise = True
        self._last_listed = 0.0
        self.num_listed = 0
        """Listings published (each a store write per decode replica changed)."""
        self._events: queue.Queue[tuple[_Step, int, torch.cuda.Event] | None] | None = None
        if cuda:  # a thread waits for each layer's event
            self._events = queue.Queue()
            threading.Thread(target=self._wait_events, name="meshserve-kv-lister",
                             daemon=True).start()

    def add(self, rid: str, transfer_id: int, decode: int) -> None:
        with self.lock:
            self.streams[rid] = Stream(transfer_id, decode)

    def close_stream(self, rid: str) -> None:
        """Its prompt is no longer computed here (finished, aborted): list no more."""
        if rid in self.streams:
            self.streams[rid].open = False

    def pop(self, rid: str) -> Stream | None:
        """The read is done: forget it, and list the rest of its decode replica's again."""
        with self.lock:
            stream = self.streams.pop(rid, None)
        if stream is not None and stream.pinned:
            self._publish_to({stream.decode})
        return stream

    def launched(self, num_tokens: int,
                 blocks_after: Callable[[str], tuple[list[int], int, bool]],
                 pin: Callable[[list[int]], None]) -> None:
        """A step is about to run: pin the blocks it completes of each open stream.
        `blocks_after(rid)`: the prompt's full blocks once it has run, whether it was ever
        preempted, and whether the step ends the prompt."""
        if self._running is not None:  # its forward called no hook to its end
            self._ended(self._running)
        ends: dict[str, tuple[int, bool]] = {}
        for rid, stream in self.streams.items():
            if not stream.open:
                continue
            blocks, preempted, last = blocks_after(rid)
            if preempted:
                stream.open = False
                continue
            if len(blocks) > len(stream.pinned):
                new = blocks[len(stream.pinned):]
                pin(new)
                with self.lock:
                    stream.pinned += new
                ends[rid] = (len(stream.pinned), last)
        layered = self._layerwise and any(last for _, last in ends.values())
        self._running = _Step(num_tokens, ends, layered) if ends else None

    def layer_done(self, layer: int, num_tokens: int) -> None:
        """The model's hook: global `layer` of the running step's forward has run (been
        enqueued, on a GPU)."""
        step = self._running
        if step is None or not self._layerwise:  # (no streamed prompt's blocks to list)
            return
        if step.num_tokens != num_tokens:
            self._unmatched(f"a forward of {num_tokens} tokens; the step launched last has "
                            f"{step.num_tokens}")
            return
        if layer == self.last:
            self._running = None
        elif not step.layered:
            return
        self._after(step, layer - self.first + 1)

    def _ended(self, step: _Step) -> None:
        """`step`'s forward has run (or been enqueued): list every layer of it."""
        self._running = None
        self._after(step, self.last - self.first + 1)

    def _after(self, step: _Step, count: int) -> None:
        """List `count` layers of `step` once they have run (on a GPU, once an event
        recorded now has completed)."""
        if self._events is None:
            self._written(step, count)
            return
        event = torch.cuda.Event()
        event.record()
        self._events.put((step, count, event))

    def close(self) -> None:
        if self._events is not None:
            self._events.put(None)

    def _wait_events(self) -> None:
        assert self._events is not None
        while (item := self._events.get()) is not None:
            step, count, event = item
            event.synchronize()
            self._written(step, count)

    def _written(self, step: _Step, count: int) -> None:
        """`count` layers of `step` have run: list them (at most every LIST_EVERY_S within
        a step; its last layer at once)."""
        last = count == self.last - self.first + 1
        changed: set[int] = set()
        with self.lock:
            for rid, (end, layered) in step.ends.items():
                stream = self.streams.get(rid)
                if stream is None:  # its read is done
                    continue
                if last:
                    stream.full = stream.partial = max(stream.full, end)
                    stream.layers = 0
                elif layered:
                    stream.partial, stream.layers = end, count
                else:
                    continue
                changed.add(stream.decode)
        now = time.monotonic()
        if changed and (last or now - self._last_listed >= LIST_EVERY_S):
            self._last_listed = now
            self._publish_to(changed)

    def _publish_to(self, decodes: set[int]) -> None:
        # One publisher at a time (the main thread's `pop`, the GPU's lister thread), so a
        # listing taken earlier never overwrites a later one.
        with self._publishing:
            for dst in decodes:
                with self.lock:
                    listed = {s.transfer_id: shown for s in self.streams.values()
                              if s.decode == dst and (shown := s.listed()).blocks}
                self._publish(dst, listed)
                self.num_listed += 1

    def _unmatched(self, why: str) -> None:
        """A forward is not the launched step's: list nothing more layer by layer (each
        step then as the next one is launched)."""
        print(f"meshserve: streamed KV is no longer listed layer by layer ({why}); each "
              "step is listed as the next one is launched", file=sys.stderr, flush=True)
        self._layerwise = False
