"""The cost model's guess at what a drafted step costs against a plain one, for the
speculation switch's batch sizes that have not been timed both ways yet."""

from __future__ import annotations

from collections.abc import Callable

from meshserve.engine.run import Run
from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.cost_model import CostModel
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.placement import layout_for
from meshserve.parallel.planner.prediction import speculative_step_s
from meshserve.parallel.planner.search import resolve_dtype


def speculation_prior(run: Run) -> Callable[[int], float] | None:
    """num_seqs -> a drafted step's time over a plain one's, priced by the cost model on
    the run's cluster (the draft model's own shape for method=draft; no draft steps for
    prompt lookup); None where the cluster described is not the device the run is on."""
    c = run.config
    spec, cluster, scenario = c.speculative, c.cluster, c.scenario
    if not spec.enabled or cluster.device_type != run.device_type:
        return None
    dtype = resolve_dtype(c.model.dtype, run.arch.dtype, run.device_type)
    tp = c.parallel.tp

    def model(arch: ModelArch, degree: int) -> CostModel:
        shape = ModelShape.from_arch(arch, dtype)
        return CostModel(shape, cluster, layout_for(degree, [(0, shape.num_layers)], 1,
                                                    cluster))

    target = model(run.arch, tp)
    draft = model(run.draft_arch, 1) if run.draft_arch is not None else None
    context = scenario.prompt_len + scenario.output_len / 2

    def ratio(num_seqs: int) -> float:
        n = max(num_seqs, 1)
        return (speculative_step_s(target, n, context, spec.num_tokens, draft,
                                   drafts=spec.method == "draft")
                / target.tpot_s(n, context))

    return ratio
