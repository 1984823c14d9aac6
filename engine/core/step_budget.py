"""engine.max_num_batched_tokens=auto: each step's token budget set so that a step
carrying decodes stays within the scenario's TPOT target (stall-free batching, as in
Sarathi-Serve), and filled to the cap when no decode waits.

A step's time is modelled as linear in what it carries: a fixed part, a part per decoding
sequence, a part per token of context the decodes read, and a part per prompt token. The
coefficients start from the cost model's prediction on the run's cluster (fitted over a
grid of steps) and are corrected by every step the engine times: a Bayesian linear
regression whose prior is the cost model's fit, so that directions the run's steps do not
vary in (a run whose steps all carry the same mix) stay where the cost model put them,
and older steps weigh less and less (a change of machine load is followed). The prompt
tokens that keep the predicted time within the target are the step's allowance; at least
MIN_PREFILL_TOKENS, so that waiting prompts always progress.
"""

from __future__ import annotations

import math
from collections.abc import Callable

MIN_PREFILL_TOKENS = 32
"""The least prompt tokens a step carrying decodes may run, even where the decodes alone
take the target: waiting prompts must progress, and the batch then shrinks as decodes
finish."""
FORGET = 0.98
"""Each timed step weighs this much less than the next one (about the latest 50 count)."""
NOISE = 0.1
"""The spread of a step's time around the model, as a fraction of the target."""
PRIOR_SPREAD = 1.0
"""The prior's spread of each coefficient, as a fraction of its value (at least
PRIOR_FLOOR of the target): the cost model may be off by its own size."""
PRIOR_FLOOR = 0.05
DECODE_SCALE = 64.0
CONTEXT_SCALE = 65536.0
"""Units of the features (decoding sequences, context tokens), keeping the regression
well conditioned; prompt tokens are in units of the cap."""

Prior = Callable[[int, int, int], float]
"""(decoding sequences, their context tokens, prompt tokens) -> predicted step seconds."""


class StepBudget:
    """The token budget of the next step, from a running model of step time."""

    def __init__(self, target_s: float, cap: int, prior: Prior | None = None) -> None:
        """`target_s`: the time a step carrying decodes should stay within (the TPOT
        target); `cap`: the most tokens a step may carry; `prior`: the cost model's step
        time (None: a flat guess, a full step at twice the target, that the run's own
        steps soon replace)."""
        if not target_s > 0:
            raise ValueError(f"scenario.tpot_slo_ms={target_s * 1e3}: allowed is a number > 0")
        self.target_s, self.cap = target_s, cap
        mean = self._fit(prior) if prior is not None else [0.25, 0.0, 0.0, 1.75]
        spread = [max(abs(m) * PRIOR_SPREAD, PRIOR_FLOOR) for m in mean]
        self._prior_precision = [1.0 / (s * s) for s in spread]
        self._prior_mean = mean
        n = len(mean)
        self._xtx = [[0.0] * n for _ in range(n)]  # the timed steps, forgetting applied
        self._xty = [0.0] * n
        self._theta = list(mean)
        self.num_observed = 0
        self.last_tokens: int | None = None
        """The budget the latest step was given (None before the first)."""

    def _features(self, num_decodes: int, context: int, num_prefill: int) -> list[float]:
        return [1.0, num_decodes / DECODE_SCALE, context / CONTEXT_SCALE, num_prefill / self.cap]

    def _fit(self, prior: Prior) -> list[float]:
        """The cost model over a grid of steps, least-squares fitted (in target units)."""
        rows, ys = [], []
        for d in (0, 1, 8, 32, 128):
            for ctx in (0, 256, 1024):
                for t in (0, self.cap // 8, self.cap // 2, self.cap):
                    if d + t == 0 or d + t > self.cap + 128 or (ctx and not d):
                        continue
                    rows.append(self._features(d, d * ctx, t))
                    ys.append(prior(d, d * ctx, t) / self.target_s)
        n = len(rows[0])
        a = [[sum(r[i] * r[j] for r in rows) + (1e-9 if i == j else 0.0) for j in range(n)]
             for i in range(n)]
        b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(n)]
        return _solve(a, b)

    def predict_s(self, num_decodes: int, context: int, num_prefill: int) -> float:
        """The step's predicted seconds."""
        x = self._features(num_decodes, context, num_prefill)
        return self.target_s * sum(a * b for a, b in zip(self._theta, x))

    def tokens(self, num_decodes: int, context: int) -> int:
        """The budget of a step carrying `num_decodes` decodes that read `context` tokens of
        KV in all: the decodes plus the prompt tokens that keep it within the target (the
        cap when no decode waits)."""
        if num_decodes == 0:
            self.last_tokens = self.cap
            return self.cap
        th = self._theta
        x = self._features(num_decodes, context, 0)
        spare = 1.0 - sum(a * b for a, b in zip(th, x))  # in target units
        per_token = th[3] / self.cap
        room = self.cap - num_decodes
        allowance = room if per_token <= 0 else min(room, math.floor(spare / per_token))
        allowance = max(allowance, min(MIN_PREFILL_TOKENS, room))
        self.last_tokens = num_decodes + max(allowance, 0)
        return self.last_tokens

    def observe(self, num_decodes: int, context: int, num_prefill: int, seconds: float) -> None:
        """A step carrying this work took `seconds` (the engine's wall time for it)."""
        if seconds <= 0 or num_decodes + num_prefill == 0:
            return
        x = self._features(num_decodes, context, num_prefill)
        y = seconds / self.target_s
        # A stalled step (a collector, the machine) counts as at most 3x its prediction.
        predicted = sum(a * b for a, b in zip(self._theta, x))
        if predicted > 0:
            y = min(y, 3.0 * predicted)
        n = len(x)
        w = 1.0 / (NOISE * NOISE)
        for i in range(n):
            self._xty[i] = FORGET * self._xty[i] + w * x[i] * y
            row = self._xtx[i]
            for j in range(n):
                row[j] = FORGET * row[j] + w * x[i] * x[j]
        a = [[self._xtx[i][j] + (self._prior_precision[i] if i == j else 0.0)
              for j in range(n)] for i in range(n)]
        b = [self._xty[i] + self._prior_precision[i] * self._prior_mean[i] for i in range(n)]
        self._theta = _solve(a, b)
        self.num_observed += 1


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (a small symmetric positive definite system; Gaussian elimination
    with partial pivoting)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if m[c][c] == 0:
            continue
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            if f:
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for c in reversed(range(n)):
        s = m[c][n] - sum(m[c][k] * x[k] for k in range(c + 1, n))
        x[c] = s / m[c][c] if m[c][c] else 0.0
    return x
