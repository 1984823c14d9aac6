"""Whether a step should carry drafts: priced each step from what a drafted and a plain
step cost at this batch size on this machine, measured as the run goes, and from the
acceptance each running request has shown.

A plain step emits one token per sequence. A drafted step emits, per speculating sequence,
the drafts it accepts and one more: the mean accepted per verify step of its own history
(acceptances of successive drafts are far from independent: a draft that got the first
token right tends to get the next one too, so a per-token rate would undercount runs). The switch keeps, per batch-size bucket (powers of two),
a running average of the seconds a drafted step and a plain step took, and lets a step
draft when its expected tokens per second beat the plain step's by a margin. Step times
are steadier than the tokens a step happens to emit, so a few steps settle the choice;
each side is timed again now and then (every PROBE_EVERY steps of the other), so a
change of machine load is followed. A bucket with nothing measured yet drafts: that
measures it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PROBE_EVERY = 32
"""Steps of one kind after which the other kind runs once, to be timed again."""
MARGIN = 1.03
"""Drafting must promise this much more than plain decoding to be chosen: its price
rests on estimated acceptance, and its times are fewer."""
WEIGHT = 0.2
"""The weight of the newest step in a running average (after the first WARM steps, whose
plain mean it starts from: a cold first step weighs no more than the others)."""
WARM = 4


@dataclass
class _Mean:
    value: float | None = None
    count: int = 0

    def add(self, x: float) -> None:
        self.count += 1
        if self.value is None:
            self.value = x
        else:
            w = max(WEIGHT, 1.0 / min(self.count, WARM))
            self.value += w * (x - self.value)


@dataclass
class _Bucket:
    drafted_s: _Mean
    plain_s: _Mean
    since_other: int = 0
    """Steps of the kind now preferred since the other kind last ran."""


class SpeculationSwitch:
    """Per batch-size bucket: draft, or decode plainly, whichever delivers more tokens/s."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self.num_drafted_steps = 0
        self.num_plain_steps = 0
        """Decode steps timed that drafted, and that did not."""

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return max(1, num_seqs).bit_length()

    def _get(self, num_seqs: int) -> _Bucket:
        b = self._buckets.get(self.bucket(num_seqs))
        if b is None:
            b = self._buckets[self.bucket(num_seqs)] = _Bucket(_Mean(), _Mean())
        return b

    @staticmethod
    def gain(accepted: Sequence[float | None]) -> float:
        """Expected tokens of a drafted step over a plain one's (a ratio >= 1), the
        sequences that would draft expecting these many accepted drafts per verify (None:
        it would not draft)."""
        return sum(1.0 + (a or 0.0) for a in accepted) / max(len(accepted), 1)

    def allow(self, accepted: Sequence[float | None]) -> bool:
        """Whether the next step of these running sequences should draft; `accepted`: per
        sequence, the drafts a verify step of it is expected to accept (None: it would
        not draft)."""
        b = self._get(len(accepted))
        d, p = b.drafted_s.value, b.plain_s.value
        if d is None or p is None:
            return d is None  # time drafting first, then plain
        prefer = self.gain(accepted) * p >= MARGIN * d
        if b.since_other >= PROBE_EVERY:
            b.since_other = 0
            return not prefer
        b.since_other += 1
        return prefer

    def observe(self, num_seqs: int, drafted: bool, seconds: float) -> None:
        """A decode step of `num_seqs` sequences took `seconds`."""
        if seconds <= 0:
            return
        b = self._get(num_seqs)
        if drafted:
            self.num_drafted_steps += 1
            b.drafted_s.add(seconds)
        else:
            self.num_plain_steps += 1
            b.plain_s.add(seconds)

    def step_seconds(self, num_seqs: int) -> tuple[float | None, float | None]:
        """The running (drafted, plain) step times of this batch size's bucket."""
        b = self._get(num_seqs)
        return b.drafted_s.value, b.plain_s.value
