"""Every message between the front and its replicas, in one place.

A replica runs in a process of its own (or, replica 0, in a thread of the front's), and
the two talk over a connection: the front sends commands (`FrontMessage`), the replica
answers with its outputs, counters and heartbeats (`ReplicaMessage`). With disaggregated
serving the same connection carries the KV hand-off's messages: a prefill replica holds
a prompt's KV and grants its read, a decode replica imports it
(engine/replicas/kv_handoff.py). Each message is a frozen dataclass: pickled as it is,
matched by its type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.core.scheduler_output import SchedulerStats
from meshserve.engine.replicas.output_deltas import PackedOutput

# --- front -> replica ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVStoreAt:
    """Disaggregated serving, right after the Run: where this run's KV store is."""

    index: int
    """The replica's index."""
    world: int
    """Replicas in the KV world."""
    host: str | None
    """None: launched, the launcher's store."""
    port: int | None


@dataclass(frozen=True, slots=True)
class Add:
    """Run a request here from its prompt (or from its imported KV)."""

    ids: list[int]
    params: SamplingParams
    request_id: str
    arrival: float


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop a request and free everything it holds here."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Uncache every unused cached block; answered with PrefixCacheReset."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Shut the replica down."""


@dataclass(frozen=True, slots=True)
class StreamTo:
    """Where a streamed prompt's KV is read from as it is computed."""

    transfer_id: int
    decode: int
    """The decode replica that reads it."""


@dataclass(frozen=True, slots=True)
class Prefill:
    """Prefill a request (max_tokens=1) and hold its prompt's KV for a decode replica."""

    ids: list[int]
    params: SamplingParams
    request_id: str
    arrival: float
    stream: StreamTo | None = None


@dataclass(frozen=True, slots=True)
class Stream:
    """A decode replica: read this prompt's blocks from prefill replica `src` as they are
    computed (disagg.stream_kv)."""

    request_id: str
    ids: list[int]
    src: int
    transfer_id: int


@dataclass(frozen=True, slots=True)
class Export:
    """A prefill replica: begin the held prompt's read and announce it in the KV store."""

    request_id: str
    transfer_id: int


@dataclass(frozen=True, slots=True)
class ReadDone:
    """A prefill replica: the read of this prompt's KV is over; unpin it."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Import:
    """A decode replica: take blocks for the prompt (and its first token, in `ids`), pull
    its KV from prefill replica `src` once the read is granted, then run the request."""

    request_id: str
    ids: list[int]
    params: SamplingParams
    arrival: float
    src: int
    src_blocks: list[int]
    transfer_id: int
    granted: bool = False
    """The front saw the grant already."""


@dataclass(frozen=True, slots=True)
class ImportCancelled:
    """A decode replica: the prefill replica refused the read (or was lost); drop it."""

    request_id: str
    why: str


# --- replica -> front ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The replica's engine is up."""

    num_blocks: int
    stats: SchedulerStats


@dataclass(frozen=True, slots=True)
class Beat:
    """A heartbeat (every BEAT_S, from a thread of its own), so a long step is no hang."""


@dataclass(frozen=True, slots=True)
class Failed:
    """The replica stopped on an error."""

    error: str


@dataclass(frozen=True, slots=True)
class Stats:
    """The replica's counters changed while it had nothing to return."""

    stats: SchedulerStats


@dataclass(frozen=True, slots=True)
class Outputs:
    """A step's outputs, as deltas of what each request had before."""

    packed: list[PackedOutput]
    stats: SchedulerStats


@dataclass(frozen=True, slots=True)
class PrefixCacheReset:
    """ResetPrefixCache's answer: blocks uncached."""

    num_freed: int
    stats: SchedulerStats


@dataclass(frozen=True, slots=True)
class Held:
    """A prefill replica holds the prompt's KV in `blocks` under a lease."""

    request_id: str
    blocks: list[int]


@dataclass(frozen=True, slots=True)
class Granted:
    """A prefill replica began the read and announced it in the KV store."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReadDenied:
    """A prefill replica refused the read (its lease lapsed, or it was aborted)."""

    request_id: str
    why: str


@dataclass(frozen=True, slots=True)
class StreamRefused:
    """A decode replica will not read the prompt as it is computed (nothing missing, or
    too little room): the import comes as for any prompt."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Imported:
    """A decode replica runs the request, with `nbytes` of its KV pulled."""

    request_id: str
    nbytes: int
    wire_s: float
    """Seconds on the wire."""
    admit_s: float
    """From the import's arrival to the request's admission."""
    early_bytes: int = 0
    """Bytes read while the prompt was still computed."""
    layered_bytes: int = 0
    """Of those, bytes of layers read while their step still ran."""


@dataclass(frozen=True, slots=True)
class ImportFailed:
    """A decode replica could not import the request's KV (or it was aborted)."""

    request_id: str
    why: str


@dataclass(frozen=True, slots=True)
class LeaseLapsed:
    """A prefill replica's lease on a prompt's KV lapsed unread."""

    request_id: str


HandoffCommand: TypeAlias = (Prefill | Stream | Export | ReadDone | Import | ImportCancelled)
"""The front's commands a replica's KV hand-off takes."""
FrontMessage: TypeAlias = KVStoreAt | Add | Abort | ResetPrefixCache | Stop | HandoffCommand
HandoffReply: TypeAlias = (Held | Granted | ReadDenied | StreamRefused | Imported
                           | ImportFailed | LeaseLapsed)
"""A replica's KV hand-off's answers."""
ReplicaMessage: TypeAlias = Ready | Beat | Failed | Stats | Outputs | PrefixCacheReset | HandoffReply
