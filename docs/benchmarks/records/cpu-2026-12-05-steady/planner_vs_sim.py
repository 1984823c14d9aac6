"""The planner's closed-form goodput against its step simulation (simulated_goodput) on
eight layouts of four scenarios, the goodput objective, the preset clusters."""

import dataclasses
import time

from meshserve.launch.config import load_config
from meshserve.launch.plan import model_shape
from meshserve.parallel.planner.disagg_search import simulated_goodput, splits
from meshserve.parallel.planner.search import evaluate, options_for

CASES = [("model=llama-3-8b", "cluster=dgx-h100", "scenario=rag"),
         ("model=llama-3-8b", "cluster=dgx-h100", "scenario=chatbot"),
         ("model=meshcoder", "cluster=local-cpu", "scenario=rag"),
         ("model=meshcoder", "cluster=local-cpu", "scenario=chatbot")]

for overrides in CASES:
    cfg = load_config(list(overrides))
    shape, cluster, options = model_shape(cfg, cfg.cluster), cfg.cluster, options_for(cfg)
    scenario = dataclasses.replace(cfg.scenario, objective="throughput")
    layouts = [(f"tp={tp} dp={dp}", evaluate(shape, cluster, scenario, (tp, 1, dp), options))
               for tp, dp in ((1, 1), (2, 1), (1, 2))]
    split = next(c for c in splits(shape, cluster, scenario, options) if c.rejected is None)
    layouts.append((split.degrees, split))
    for name, layout in layouts:
        start = time.time()
        simulated = simulated_goodput(shape, cluster, scenario, options, layout)
        closed = layout.prediction.goodput_req_s
        print(f"{' '.join(o.split('=')[1] for o in overrides)} | {name} | closed {closed:.3f} "
              f"| simulated {simulated:.3f} | x{closed / simulated:.2f} "
              f"| {time.time() - start:.1f} s", flush=True)
