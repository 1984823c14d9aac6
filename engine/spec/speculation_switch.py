"""Whether a step should carry drafts: priced each step from what a drafted and a plain
step cost at this batch size on this machine, measured as the run goes, and from the
acceptance each running request has shown.

A plain step emits one token per sequence. A drafted step emits, per speculating sequence,
the drafts it accepts and one more: the mean accepted per verify step of its own history.
(Acceptances of successive drafts are far from independent: a draft that got the first
token right tends to get the next one too, so a per-token rate would undercount runs.)
The switch keeps, per batch-size bucket (powers of two), the median of the latest times a
drafted and a plain step took, and lets a step draft when its expected tokens per second
beat the plain step's by a margin. Step times are steadier than the tokens a step happens
to emit, and a median shrugs off a stalled step, so a few steps settle the choice. The
losing side is timed again now and then (after PROBE_EVERY steps, then ever fewer while
the choice holds), so a change of machine load is followed. A bucket not yet timed both
ways times a plain step and prices drafting by the drafted-to-plain ratio of the nearest
bucket that has (scaled as the cost model's prediction of that ratio grows between the
two), else by the cost model's prediction alone (else it times a drafted step first).
Only a price the cost model had a hand in, or a smaller batch size that priced drafting
out (a drafted step's extra rows weigh no less as the batch grows), rules drafting out
untimed: otherwise a neighbour's ratio is probed like any other price.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

PROBE_EVERY = 32
"""Steps of the preferred kind after which the other kind runs once, to be timed again;
the interval doubles (up to MAX_PROBE_EVERY) each time the preference holds, and starts
over when it flips: a probe of a losing side costs what it loses."""
MAX_PROBE_EVERY = 1024
PROBE_BAND = 1.25
"""Drafting priced at less than 1/PROBE_BAND of plain decoding's tokens/s is probed only
every MAX_PROBE_EVERY steps, and only where the draft model lags by at most
MAX_CATCH_UP tokens in all (at a large batch a drafted step costs several plain ones,
and catching the draft model up on what it skipped costs more; at a small one a price
set in a slow spell of the machine would otherwise hold for good)."""
MAX_CATCH_UP = 1024
MARGIN = 1.03
"""Drafting must promise this much more than plain decoding to be chosen: its price
rests on estimated acceptance, and its times are fewer."""
SHIFT = 0.25
"""A probe this far (relatively) from its side's median starts the probe interval over
and replaces that side's earlier times."""
WINDOW = 9
"""Step times a side's estimate is the median of (its latest): a step stalled by the
machine or a collector does not move it, a change of load does within a few steps."""


class _Mean:
    """The median of the latest WINDOW samples."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=WINDOW)
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.samples.append(x)
        self.value = statistics.median(self.samples)


@dataclass
class _Bucket:
    drafted_s: _Mean = field(default_factory=_Mean)
    plain_s: _Mean = field(default_factory=_Mean)
    since_other: int = 0
    """Steps of the kind now preferred since the other kind last ran."""
    interval: int = PROBE_EVERY
    prefer: bool | None = None
    retime: bool = False
    """The last drafted step also caught the draft model up: draft the next one to time."""


class SpeculationSwitch:
    """Per batch-size bucket: draft, or decode plainly, whichever delivers more tokens/s."""

    def __init__(self, prior: Callable[[int], float] | None = None,
                 probe_length: int = 1) -> None:
        """`prior(num_seqs)`: a drafted step's time over a plain one's at that batch, as
        the cost model predicts it, for buckets nothing has timed both ways yet."""
        self.prior = prior
        self.probe_length = probe_length
        """Steps a probe (or a re-timing) lasts: a pipeline times a micro-batch only
        while the micro-batches beside it in the pipeline are of its kind, so a probe
        runs one longer than the pipeline holds."""
        self._held: tuple[int, int, bool] | None = None
        """A probe run under way: (bucket, steps left, its choice); the next steps of that
        bucket repeat the choice, a step of another bucket ends it."""
        self._priors: dict[int, float] = {}
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
            b = self._buckets[self.bucket(num_seqs)] = _Bucket()
        return b

    @staticmethod
    def gain(accepted: Sequence[float | None]) -> float:
        """Expected tokens of a drafted step over a plain one's (a ratio >= 1), the
        sequences that would draft expecting these many accepted drafts per verify (None:
        it would not draft)."""
        return sum(1.0 + (a or 0.0) for a in accepted) / max(len(accepted), 1)

    def allow(self, accepted: Sequence[float | None], lag: int = 0,
              num_seqs: int | None = None) -> bool:
        """Whether the next step of these running sequences should draft; `accepted`: per
        sequence, the drafts a verify step of it is expected to accept (None: it would
        not draft); `lag`: the tokens the draft model would catch up on first;
        `num_seqs`: the batch size its times are kept under (default: one per sequence;
        a pipeline's micro-batch is priced at every running sequence)."""
        n = len(accepted) if num_seqs is None else num_seqs
        bucket = self.bucket(n)
        held, self._held = self._held, None
        if held is not None and held[0] == bucket:
            if held[1] > 1:
                self._held = (bucket, held[1] - 1, held[2])
            return held[2]
        b = self._get(n)
        choice = self._choose(b, n, accepted, lag)
        if choice != b.prefer and self.probe_length > 1:
            self._held = (bucket, self.probe_length - 1, choice)
        return choice

    def _choose(self, b: _Bucket, num_seqs: int, accepted: Sequence[float | None],
                lag: int) -> bool:
        """allow()'s choice for one step."""
        if b.retime:
            b.retime = False
            return True
        d, p = self._times(num_seqs)
        if d is None:
            return True  # nothing to price drafting with: time it first, then plain
        if p is None:
            return False  # time plain, then price drafting
        gain = self.gain(accepted)
        promise = gain * p / d  # drafted tokens/s over plain, as priced
        prefer = promise >= MARGIN
        if prefer != b.prefer:
            b.prefer, b.interval, b.since_other = prefer, PROBE_EVERY, 0
        # Too far behind for a probe to tell anything worth its cost, once priced by the
        # cost model or by three timed steps (one alone may be a cold one), or where a
        # smaller batch size already prices it out. A ratio carried from a larger batch
        # size with no cost model to scale it is a guess: it orders the probes like any
        # price, and drafting is timed here before it is ruled out.
        timed = len(b.drafted_s.samples)
        if not prefer and promise < 1 / PROBE_BAND and (
                timed >= 3 or (timed == 0 and self.prior is not None)
                or self._behind_below(num_seqs, gain)):
            if timed == 0 or lag > MAX_CATCH_UP or b.since_other < MAX_PROBE_EVERY:
                b.since_other += 1
                return False
            b.since_other = 0
            return True
        if b.since_other >= b.interval:
            b.since_other = 0
            b.interval = min(2 * b.interval, MAX_PROBE_EVERY)
            return not prefer
        b.since_other += 1
        return prefer

    def may_draft_soon(self, num_seqs: int, accepted: float) -> bool:
        """Whether steps of `num_seqs` sequences expecting `accepted` drafts per verify
        could draft, or be probed: drafting not priced out of the probe band (or not
        priced yet). Prompts joining such a batch are worth running on the draft model
        too, so that drafting them later needs no catch-up."""
        d, p = self._times(num_seqs)
        if d is None or p is None:
            return True
        return (1.0 + accepted) * p / d >= 1 / PROBE_BAND

    def _times(self, num_seqs: int) -> tuple[float | None, float | None]:
        """(drafted, plain) step seconds of this batch size's bucket: as timed, else
        drafted priced from plain by the nearest timed bucket's ratio or the prior (inf
        while plain is untimed too); drafted None where nothing prices it."""
        b = self._get(num_seqs)
        d, p = b.drafted_s.value, b.plain_s.value
        if d is None:
            ratio = self._nearest_ratio(num_seqs)
            if ratio is None and self.prior is not None:
                ratio = self._prior(self.bucket(num_seqs))
            if ratio is not None:
                d = math.inf if p is None else p * ratio
        return d, p

    def _behind_below(self, num_seqs: int, gain: float) -> bool:
        """Whether a smaller batch size, its drafting timed at least three times, prices
        drafting with this `gain` out of the probe band. A drafted step's extra rows weigh
        no less as the batch grows, so a smaller batch's drafted-to-plain ratio bounds
        this one's from below: probing here would cost more and tell nothing new."""
        here = self.bucket(num_seqs)
        return any(gain * b.plain_s.value < b.drafted_s.value / PROBE_BAND
                   for k, b in self._buckets.items()
                   if k < here and len(b.drafted_s.samples) >= 3 and b.plain_s.value
                   and b.drafted_s.value is not None)

    def _nearest_ratio(self, num_seqs: int) -> float | None:
        """Drafted over plain step time in the nearest bucket that timed both, carried to
        this batch size as the prior grows between the two (a verify's extra rows weigh
        more as the batch fills the hardware)."""
        here = self.bucket(num_seqs)
        timed = [(abs(k - here), k, b.drafted_s.value / b.plain_s.value)
                 for k, b in self._buckets.items()
                 if b.drafted_s.value is not None and b.plain_s.value]
        if not timed:
            return None
        _, k, ratio = min(timed)
        if self.prior is None:
            return ratio
        return ratio * self._prior(here) / self._prior(k)

    def _prior(self, bucket: int) -> float:
        """The prior at a bucket's smallest batch, priced once (the cost model is slow
        next to a step's host work)."""
        ratio = self._priors.get(bucket)
        if ratio is None:
            assert self.prior is not None
            ratio = self._priors[bucket] = self.prior(1 << (bucket - 1))
        return ratio

    def observe(self, num_seqs: int, drafted: bool, seconds: float,
                caught_up: bool = False) -> None:
        """A decode step of `num_seqs` sequences took `seconds`; `caught_up`: a drafted
        step that also ran the draft model over tokens it had skipped (a one-time cost,
        not timed: the next step drafts again to be timed)."""
        if seconds <= 0:
            return
        b = self._get(num_seqs)
        if drafted and caught_up:
            b.retime = True
            return
        side = b.drafted_s if drafted else b.plain_s
        if drafted:
            self.num_drafted_steps += 1
        else:
            self.num_plain_steps += 1
        if (b.prefer is not None and drafted != b.prefer and side.value is not None
                and abs(seconds - side.value) > SHIFT * side.value):
            b.interval = PROBE_EVERY  # the losing side changed: time it again soon,
            side.samples.clear()  # and forget its times from before the change
        side.add(seconds)

    def step_seconds(self, num_seqs: int) -> tuple[float | None, float | None]:
        """The running (drafted, plain) step times of this batch size's bucket."""
        b = self._get(num_seqs)
        return b.drafted_s.value, b.plain_s.value
