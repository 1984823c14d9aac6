"""The cost model's guess at what a drafted step costs against a plain one, for the
speculation switch's batch sizes that have not been timed both ways yet."""

from __future__ import annotations

from collections.abc import Callable

from meshserve.engine.config.run import Run
from meshserve.engine.timing.step_budget_prior import run_cost_model
from meshserve.parallel.planner.prediction import speculative_step_s


def speculation_prior(run: Run) -> Callable[[int], float] | None:
    """num_seqs -> a drafted step's time over a plain one's, priced by the cost model on
    the run's cluster (the draft model's own shape for method=draft; no draft steps for
    prompt lookup); None where the cluster described is not the device the run is on."""
    c = run.config
    spec, scenario = c.speculative, c.scenario
    if not spec.enabled:
        return None
    target = run_cost_model(run, run.arch, c.parallel.tp)
    if target is None:
        return None
    draft = run_cost_model(run, run.draft_arch, 1) if run.draft_arch is not None else None
    context = scenario.prompt_len + scenario.output_len / 2

    def ratio(num_seqs: int) -> float:
        n = max(num_seqs, 1)
        return (speculative_step_s(target, n, context, spec.num_tokens, draft,
                                   drafts=spec.method == "draft")
                / target.tpot_s(n, context))

    return ratio
