"""Request outputs between a replica process and its front, as deltas.

A RequestOutput carries everything so far: the prompt's ids, every output token, the text,
every logprob. A replica in another process sends one per running request per step, so
sending them whole costs a step time that grows with prompt and output length (a RAG
prompt of 2,000 tokens, pickled and unpickled at every step of every request). The
replica's `OutputPacker` sends what is new (and the prompt once, with a request's first
output); the front's `OutputUnpacker` keeps what came before and rebuilds each output
whole, as the engine in the replica returned it.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.engine.core.outputs import RequestMetrics, RequestOutput


@dataclass(slots=True)
class PackedOutput:
    """What is new in one request's output since the last one sent for it."""

    request_id: str
    prompt_token_ids: list[int] | None
    """The prompt's ids with a request's first output, then None."""
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] | None
    """The logprobs of new_token_ids (None: the request asked for none)."""
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    replica: int
    error: str | None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With a request's first output, where it asked for them."""


class OutputPacker:
    """A replica's side: each output as its delta."""

    def __init__(self) -> None:
        self._started: set[str] = set()

    def pack(self, outs: list[RequestOutput]) -> list[PackedOutput]:
        packed = []
        for o in outs:
            first = o.request_id not in self._started
            if o.finished:
                self._started.discard(o.request_id)
            elif first:
                self._started.add(o.request_id)
            lps = o.logprobs
            packed.append(PackedOutput(
                o.request_id, o.prompt_token_ids if first else None, o.new_token_ids,
                o.new_text, lps[len(lps) - len(o.new_token_ids):] if lps is not None else None,
                o.finished, o.finish_reason, o.metrics, o.replica, o.error,
                o.prompt_logprobs if first else None))
        return packed

    def forget(self, request_id: str) -> None:
        """An aborted request: no more outputs come for it."""
        self._started.discard(request_id)


@dataclass(slots=True)
class _SoFar:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None
    prompt_logprobs: list[dict[int, float] | None] | None


class OutputUnpacker:
    """The front's side, one per replica: each delta as the whole output."""

    def __init__(self) -> None:
        self._so_far: dict[str, _SoFar] = {}

    def unpack(self, packed: list[PackedOutput]) -> list[RequestOutput]:
        outs = []
        for p in packed:
            if p.prompt_token_ids is not None:  # a first output (the id may be reused)
                s = _SoFar(p.prompt_token_ids, [], "",
                           [] if p.new_logprobs is not None else None, p.prompt_logprobs)
                self._so_far[p.request_id] = s
            else:
                s = self._so_far[p.request_id]
            if p.finished:
                del self._so_far[p.request_id]
            s.token_ids += p.new_token_ids
            s.text += p.new_text
            if s.logprobs is not None and p.new_logprobs is not None:
                s.logprobs += p.new_logprobs
            outs.append(RequestOutput(
                request_id=p.request_id, prompt_token_ids=s.prompt_token_ids,
                token_ids=list(s.token_ids), text=s.text, new_token_ids=p.new_token_ids,
                new_text=p.new_text, finished=p.finished, finish_reason=p.finish_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                prompt_logprobs=s.prompt_logprobs, metrics=p.metrics, replica=p.replica,
                error=p.error))
        return outs

    def forget(self, request_id: str) -> None:
        """An aborted request (or one whose replica was lost): drop what came of it."""
        self._so_far.pop(request_id, None)
