"""What `meshserve diagnose` says of an automatic step budget
(engine.max_num_batched_tokens=auto): the budgets the steps were given, and how long the
steps carrying decodes took against the TPOT target."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


class BudgetedLike(Protocol):
    """What the report reads of a step record (diagnosis.StepRecord)."""

    token_budget: int | None
    num_decode_seqs: int
    num_prefill_tokens: int
    wall_s: float


@dataclass(frozen=True, kw_only=True)
class StepBudgetReport:
    """The budgets of the steps that had one, and the decode-carrying steps' times."""

    num_steps: int
    """Steps given an automatic budget."""
    budget_p10: int
    budget_p50: int
    budget_p90: int
    num_decode_steps: int
    """Of them, steps carrying decodes."""
    decode_step_p50_s: float
    decode_step_p99_s: float
    target_s: float | None
    """The TPOT target the budget kept to (None: not known to the reader)."""
    over_target: float | None
    """Share of the decode-carrying steps that took longer than the target."""

    def describe(self) -> str:
        text = (f"step budget: automatic on {self.num_steps} steps, {self.budget_p50} tokens "
                f"at the median (p10 {self.budget_p10}, p90 {self.budget_p90}); the "
                f"{self.num_decode_steps} steps carrying decodes took "
                f"{self.decode_step_p50_s * 1e3:.1f} ms at the median, "
                f"{self.decode_step_p99_s * 1e3:.1f} ms at p99")
        if self.target_s is not None and self.over_target is not None:
            text += (f", against a TPOT target of {self.target_s * 1e3:.1f} ms "
                     f"({self.over_target:.0%} of them over it)")
        return text


def _quantile(xs: Sequence[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def step_budget_report(records: Iterable[BudgetedLike],
                       target_s: float | None = None) -> StepBudgetReport | None:
    """The report of the records that carry a token budget; None if none does."""
    budgeted = [r for r in records if r.token_budget is not None]
    if not budgeted:
        return None
    budgets = sorted(float(r.token_budget or 0) for r in budgeted)
    times = sorted(r.wall_s for r in budgeted if r.num_decode_seqs)
    over = (sum(t > target_s for t in times) / len(times)
            if target_s is not None and times else None)
    return StepBudgetReport(
        num_steps=len(budgeted), budget_p10=int(_quantile(budgets, 0.1)),
        budget_p50=int(_quantile(budgets, 0.5)), budget_p90=int(_quantile(budgets, 0.9)),
        num_decode_steps=len(times),
        decode_step_p50_s=_quantile(times, 0.5) if times else 0.0,
        decode_step_p99_s=_quantile(times, 0.99) if times else 0.0,
        target_s=target_s, over_target=over)
