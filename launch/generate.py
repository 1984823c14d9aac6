"""`meshserve generate`: complete the configured prompts, print them and a speed line."""

from __future__ import annotations

import statistics
import sys
import time

from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.llm import LLM
from meshserve.launch.cli_config import load_config
from meshserve.parallel.comm.ranks import RankFailure


def run(overrides: list[str]) -> int:
    """Load the model, generate, print; returns the exit code (1 when a rank failed).

    With parallel.tp / pp > 1 the ranks are self-spawned, or under torchrun every rank
    runs this and all but rank 0 serve it (they exit inside LLM()).
    """
    cfg = load_config(overrides)
    g = cfg.generate
    try:
        params = SamplingParams(
            max_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
            min_p=g.min_p, presence_penalty=g.presence_penalty,
            frequency_penalty=g.frequency_penalty, repetition_penalty=g.repetition_penalty,
            seed=g.seed, ignore_eos=g.ignore_eos)
    except ValueError as e:
        print(f"meshserve generate: config error: generate.{e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        llm = LLM(config=cfg.runtime)
    except RankFailure as e:
        print(f"meshserve generate: {e}", file=sys.stderr)
        return 1
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        outs = llm.generate(list(g.prompts), params)
    except RankFailure as e:
        print(f"meshserve generate: {e}", file=sys.stderr)
        return 1
    finally:
        llm.shutdown()
    wall = time.perf_counter() - t1
    for prompt, out in zip(g.prompts, outs):
        print(f"--- prompt: {prompt!r}  ({out.finish_reason}, {len(out.token_ids)} tokens)")
        print(prompt + out.text)
    print(speed_line(outs, wall, load_s, cfg.model.label, llm.engine.device.type))
    return 0


def speed_line(outs: list[RequestOutput], wall: float, load_s: float, model: str,
               device: str) -> str:
    """One line of speed figures for a finished batch."""
    gen = sum(len(o.token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    ttft = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    return (f"=== {model} on {device}: {len(outs)} requests, {prompt} prompt + {gen} generated "
            f"tokens in {wall:.2f} s -> {gen / wall:.1f} generated tok/s; "
            f"TTFT mean {1e3 * statistics.fmean(ttft) if ttft else float('nan'):.1f} ms, "
            f"TPOT mean {1e3 * statistics.fmean(tpot) if tpot else float('nan'):.1f} ms "
            f"(model load {load_s:.1f} s)")
