"""Whether a step should carry drafts: decided from what drafted and plain steps have
delivered at this batch size on this machine, measured as the run goes.

Speculation pays when a verify step's extra tokens (accepted drafts) outweigh what it
costs over a plain step, and that depends on the batch (at small batches the step leaves
compute idle, at large ones it is busy), the acceptance of the running requests and the
machine. So the switch keeps, per batch-size bucket (powers of two), a running average
of output tokens per second of steps with drafts and of steps without, and lets a step
draft while its bucket's drafted rate beats the plain one by a margin. Either side is measured
again now and then (every PROBE_EVERY steps of the other), so a change of workload is
followed. A bucket with nothing measured yet drafts: that measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 32
"""Steps of one kind after which the other kind runs once, to be measured again."""
MARGIN = 1.03
"""Drafting must deliver this much more than plain decoding to be chosen: a step that
drafts costs what it measures, and its measure is noisier (fewer of its kind)."""
WEIGHT = 0.2
"""The weight of the newest step in a running average."""


@dataclass
class _Bucket:
    drafted_rate: float | None = None
    plain_rate: float | None = None
    since_other: int = 0
    """Steps of the kind now chosen since the other kind last ran."""


class SpeculationSwitch:
    """Per batch-size bucket: draft, or decode plainly, whichever delivers more tokens/s."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self.num_drafted_steps = 0
        self.num_plain_steps = 0
        """Steps of running sequences that drafted, and that did not (the switch's own)."""

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return max(1, num_seqs).bit_length()

    def allow(self, num_seqs: int) -> bool:
        """Whether the next step of `num_seqs` running sequences should draft."""
        b = self._buckets.setdefault(self.bucket(num_seqs), _Bucket())
        if b.drafted_rate is None or b.plain_rate is None:
            return b.drafted_rate is None  # measure drafting first, then plain
        prefer = b.drafted_rate >= MARGIN * b.plain_rate
        return prefer if b.since_other < PROBE_EVERY else not prefer

    def observe(self, num_seqs: int, drafted: bool, num_tokens: int, seconds: float) -> None:
        """A decode step's result: `num_tokens` output tokens in `seconds`."""
        if seconds <= 0 or num_tokens <= 0:
            return
        b = self._buckets.setdefault(self.bucket(num_seqs), _Bucket())
        rate = num_tokens / seconds
        if drafted:
            self.num_drafted_steps += 1
            b.drafted_rate = rate if b.drafted_rate is None else (
                (1 - WEIGHT) * b.drafted_rate + WEIGHT * rate)
        else:
            self.num_plain_steps += 1
            b.plain_rate = rate if b.plain_rate is None else (
                (1 - WEIGHT) * b.plain_rate + WEIGHT * rate)
        if b.drafted_rate is not None and b.plain_rate is not None:
            prefer = b.drafted_rate >= MARGIN * b.plain_rate
            b.since_other = b.since_other + 1 if drafted == prefer else 0
