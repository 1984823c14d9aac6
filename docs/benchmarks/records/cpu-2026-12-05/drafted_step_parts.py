"""Where a drafted step's time goes: every step drafts (speculative.max_batch_size=1), six
held-out prompts one at a time, 128 tokens; wall time per step of the scheduler, the
draft model (propose, its lean-step loop), every model execute and the verification."""

import collections
import time
from collections.abc import Callable

import torch

from meshserve.bench.speculative import heldout_prompts
from meshserve.engine import engine, scheduler
from meshserve.engine.llm import LLM
from meshserve.engine.sampling_params import SamplingParams
from meshserve.engine.worker import draft_proposer, model_runner, step_sampler

SECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def timed(cls: type, name: str, key: str) -> None:
    inner: Callable = getattr(cls, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        t = time.perf_counter()
        out = inner(*args, **kwargs)
        SECONDS[key] += time.perf_counter() - t
        CALLS[key] += 1
        return out

    setattr(cls, name, wrapper)


def main() -> None:
    torch.set_num_threads(1)
    timed(draft_proposer.DraftProposer, "propose", "propose")
    timed(draft_proposer.DraftProposer, "_decode_loop", "draft loop")
    timed(model_runner.ModelRunner, "execute", "execute(all)")
    timed(step_sampler.StepSampler, "_verify", "verify-sample")
    timed(engine.Engine, "_step_sync", "step")
    timed(scheduler.Scheduler, "schedule", "schedule")
    texts = heldout_prompts()[:6]
    sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm = LLM("meshcoder", overrides=["parallel=single", "threads=1", "device=cpu",
                                      "speculative=draft", "speculative.max_batch_size=1"],
              progress=False)
    for text in texts:
        llm.generate([text], sp)
    SECONDS.clear()
    CALLS.clear()
    t = time.perf_counter()
    n = sum(len(llm.generate([text], sp)[0].token_ids) for text in texts)
    dt = time.perf_counter() - t
    steps = CALLS["step"]
    print(round(n / dt, 1), "tok/s", steps, "steps", round(dt / steps * 1e3, 3), "ms/step")
    for key, s in SECONDS.items():
        print(f"{key:16s} {CALLS[key]:5d} {s * 1e3 / steps:.3f} ms/step")
    llm.shutdown()


if __name__ == "__main__":
    main()
