"""A decode replica's KV imports in flight, as its KV hand-off keeps them
(engine/replicas/kv_handoff.py): what each import holds and how far its reads got, a
prompt to be read as it is computed, and what a transfer thread reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.engine.core.block_manager import KVImport
from meshserve.engine.core.sampling_params import SamplingParams


@dataclass
class PendingImport:
    """One import on this decode replica: the blocks it took and how far its reads got."""

    imp: KVImport
    ids: list[int]
    params: SamplingParams | None
    """None until a streamed prompt's import comes, with its first token."""
    arrival: float
    src: int
    src_blocks: list[int]
    transfer_id: int
    received: float = 0.0
    """When the import came (this side's clock)."""
    announced: bool = False
    """Whether the grant is still to be seen in the KV store (the front had not seen it
    when the import came)."""
    running: bool = False
    aborted: bool = False
    streamed: bool = False
    """Begun as its prompt's prefill started: parts are read while `final` is False."""
    final: bool = True
    """Whether the import itself has come (the first token, and the blocks left)."""
    have: list[int] = field(default_factory=list)
    """Layers written so far of each fresh block (`imp.blocks`) by the streamed parts."""
    pulling: list[int] = field(default_factory=list)
    """`have` once the part in flight has landed."""
    error: str | None = None
    """A streamed part failed: the import fails when it comes."""
    still_writing: bool = False
    """A read of it failed and may still write into its blocks: they are kept out of use."""
    nbytes: int = 0
    wire_s: float = 0.0
    early_bytes: int = 0
    """Bytes read before the import came (while the prompt was still computed)."""
    layered_bytes: int = 0
    """Of those, bytes of layers read while their step still ran."""

    def __post_init__(self) -> None:
        self.have = self.have or [0] * len(self.imp.blocks)


@dataclass(frozen=True)
class ReadReport:
    """A transfer thread's report: a streamed part (`part`) or a whole pull ended."""

    part: bool
    request_id: str
    nbytes: int
    layered: int
    """Of the bytes, those of layers read while their step still ran."""
    seconds: float
    error: str | None
    still_writing: bool = False
    """The failed read may still write into its blocks (ReadStillActive)."""


@dataclass
class PlannedStream:
    """A prompt this decode replica reads as it is computed, once its first block is."""

    ids: list[int]
    src: int
    transfer_id: int


Read = tuple[list[int], list[int], tuple[int, int]]
"""One connector pull: source blocks, destination blocks, global layers [start, stop)."""
