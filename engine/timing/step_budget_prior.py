"""The cost model's step time on the run's cluster: the prior of the automatic step
budget (engine.max_num_batched_tokens=auto), and the builder the speculation prior
shares."""

from __future__ import annotations

from meshserve.engine.config.run import Run
from meshserve.engine.core.step_budget import Prior
from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.cost_model import CostModel, StepWork
from meshserve.parallel.planner.placement import layout_for
from meshserve.parallel.planner.search import shape_for

CHUNK_TOKENS = 512
"""The prompt length the prior prices a step's prompt tokens in (attention grows with it)."""


def run_cost_model(run: Run, arch: ModelArch, tp: int) -> CostModel | None:
    """The cost model of `arch` at TP degree `tp`, one stage, on the run's cluster; None
    where the cluster described is not the device the run is on."""
    c = run.config
    if c.cluster.device_type != run.device_type:
        return None
    shape = shape_for(c, arch, run.device_type)
    return CostModel(shape, c.cluster, layout_for(tp, [(0, shape.num_layers)], 1, c.cluster))


def step_time_prior(run: Run) -> Prior | None:
    """(decoding sequences, their context tokens, prompt tokens) -> a step's seconds as the
    cost model prices it for the run's model and TP degree (the prompt tokens as whole
    prompts of up to CHUNK_TOKENS); None where the cost model does not describe the run's device."""
    cost = run_cost_model(run, run.arch, run.config.parallel.tp)
    if cost is None:
        return None

    def seconds(num_decodes: int, context: int, num_prefill: int) -> float:
        work = StepWork(num_new_tokens=num_decodes, num_seqs=num_decodes,
                        num_kv_read=context, num_attended=context + num_decodes)
        if num_prefill:
            chunks = -(-num_prefill // CHUNK_TOKENS)
            work = work + StepWork.prefill(num_prefill / chunks, 0, chunks)
        return cost.step(work).total_s

    return seconds
