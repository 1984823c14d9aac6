"""A replica's saturated throughput, measured against the planner's simulation of it.

A burst of 4 x max_num_seqs alike requests (random prompt tokens, a fixed output, no
prefix cache) goes into one engine on this machine; alike requests finish in waves of a
batch each, and the middle two waves give the completions per second the replica
sustains when it cannot keep up. The same burst is simulated step by step on the
planner's cost model for `--cluster` (a `meshserve calibrate` preset of this machine):
`serving_sim.replica_capacity`, the bound `meshserve plan ... plan.simulate=true` puts
on a layout's goodput. Their ratio says how far that bound can be trusted here.

    python -m meshserve.bench.capacity --prompt 1000 --output 64 --max-seqs 8 --cluster cpu.yaml
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace

import torch

from meshserve.bench.layout_check import load_cluster
from meshserve.engine.config.runtime_config import load_runtime_config
from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.llm import LLM
from meshserve.models.bundled import resolve_arch
from meshserve.parallel.planner.layout_sim import step_time
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.search import options_for, sized
from meshserve.parallel.planner.serving_sim import SimRequest, replica_capacity, wave_rate


def measure(model: str, prompt: int, output: int, max_seqs: int, budget: int) -> float:
    """Requests per second one single-threaded engine completes from the burst."""
    llm = LLM(model, overrides=["parallel=single", "threads=1", "device=cpu",
                                f"engine.max_num_seqs={max_seqs}",
                                f"engine.max_num_batched_tokens={budget}",
                                "engine.enable_prefix_caching=false"], progress=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 4000) for _ in range(prompt)] for _ in range(4 * max_seqs)]
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], params)  # untimed: the first step's one-off costs
    outs = llm.generate(prompts, params)
    return wave_rate([o.metrics.finish_time for o in outs], max_seqs)


def simulated(model: str, cluster_path: str, prompt: int, output: int, max_seqs: int,
              budget: int) -> float:
    """The same burst on the planner's cost model for the cluster preset."""
    cfg = load_runtime_config([f"model={model}"])
    cluster = load_cluster(cluster_path)
    shape = ModelShape.from_arch(resolve_arch(cfg.model), "float32")
    scenario = replace(cfg.scenario, prompt_len=prompt, output_len=output,
                       shared_prefix_fraction=0.0, max_batch=max_seqs)
    options = replace(options_for(cfg), max_num_batched_tokens=budget)
    _, cost = sized(shape, cluster, scenario, 1, 1, options)
    if cost is None:
        raise ValueError(f"model={model}: the planner rejects one replica on {cluster_path}")
    return replica_capacity(SimRequest(0.0, prompt, output), step_time(cost), budget=budget,
                            max_seqs=max_seqs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="meshcoder")
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument("--max-seqs", type=int, default=8, help="engine.max_num_seqs")
    ap.add_argument("--budget", type=int, default=512, help="engine.max_num_batched_tokens")
    ap.add_argument("--cluster", default="local-cpu",
                    help="cluster preset or YAML file (meshserve calibrate's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    got = measure(args.model, args.prompt, args.output, args.max_seqs, args.budget)
    sim = simulated(args.model, args.cluster, args.prompt, args.output, args.max_seqs,
                    args.budget)
    print(json.dumps({"prompt": args.prompt, "output": args.output,
                      "max_seqs": args.max_seqs, "budget": args.budget,
                      "measured_req_s": round(got, 4), "simulated_req_s": round(sim, 4),
                      "measured_over_simulated": round(got / sim, 3)}))


if __name__ == "__main__":
    main()
