"""What the engine returns for a request: tokens, text, timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and token counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    """Speculative decoding: tokens drafted for this request and verified."""
    num_accepted_tokens: int = 0
    """Of those, the ones accepted."""

    @property
    def ttft(self) -> float | None:
        """Arrival to first generated token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, seconds."""
        if self.finish_time is None or self.first_token_time is None or \
                self.num_generated_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e(self) -> float | None:
        """Arrival to finish, seconds."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state after a step (streaming) or at the end (offline)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    """Generated token ids so far."""
    text: str = ""
    """Generated text so far (stop strings cut off)."""
    new_token_ids: list[int] = field(default_factory=list)
    """Tokens added by the latest step."""
    new_text: str = ""
    """Text added by the latest step."""
    finished: bool = False
    finish_reason: str | None = None
    """'stop', 'length' or 'abort' once finished; 'error' when the replica running it was
    lost (see `error`)."""
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    """Per generated token: its logprob and the top-n alternatives (when asked)."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """Asked for (`SamplingParams.prompt_logprobs=k`): per prompt token None for the first,
    then a mapping of token id to log-prob holding the prompt token and the top k at its
    position (vLLM's shape); complete from the first output on."""
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    replica: int = 0
    """The data-parallel replica that ran it."""
    error: str | None = None
    """Why the request failed (its replica's ranks died or hung); None unless it did."""
