"""What sampling options cost a step: a batch decoding under a JSON schema (each grammar
backend) or with every penalty and a logit bias, against the same batch decoding free,
rounds alternating, in one run.

    python -m meshserve.bench.sampling_cost --batch 16 --tokens 96 --rounds 3

Every request decodes exactly `--tokens` tokens (EOS ignored, the schema's one string long
enough never to close), so every side runs the same steps; the figure is the mean time per
decode step (wall time of the batch over its tokens) and the ratio to free decoding. For
the grammars also the mask itself: filling one step's bitmasks, per sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from meshserve.engine.core.sampling_params import SamplingParams, StructuredOutputs
from meshserve.engine.llm import LLM
from meshserve.engine.worker.sampling.grammar import make_grammars

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 2000},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
    "required": ["title", "year"], "additionalProperties": False}
PROMPT = "record = "


PENALTIES: dict[str, Any] = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                 logit_bias={7: 2.0, 11: -5.0})


def step_ms(llm: LLM, batch: int, tokens: int, kind: str) -> float:
    so = StructuredOutputs(json=SCHEMA) if kind == "constrained" else None
    extra = PENALTIES if kind == "penalized" else {}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                            structured_outputs=so, **extra)
    t0 = time.perf_counter()
    outs = llm.generate([PROMPT] * batch, params)
    elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == tokens for o in outs)
    return 1e3 * elapsed / tokens


def mask_us(llm: LLM, batch: int, steps: int = 50) -> float:
    """Filling the bitmasks of `batch` fresh matchers, per sequence and step."""
    grammars = make_grammars(llm.engine.run)
    so = StructuredOutputs(json=SCHEMA)
    ids = list(range(batch))
    for i in ids:
        grammars.track(i, so)
    taken = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = grammars.bitmask(ids)
        taken += time.perf_counter() - t0
        allowed = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)
        grammars.accept(ids, [int(row.nonzero()[-1]) for row in allowed])
    return 1e6 * taken / steps / batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="meshcoder")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for backend in ("xgrammar", "llguidance"):
        llm = LLM(args.model, overrides=["parallel=single", "threads=1",
                                         f"engine.structured_outputs_backend={backend}"],
                  progress=False)
        try:
            kinds = ["free", "constrained"] + ["penalized"] * (backend == "xgrammar")
            for kind in kinds:  # warm every path
                step_ms(llm, args.batch, 8, kind)
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for r in range(args.rounds):
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    times[kind].append(step_ms(llm, args.batch, args.tokens, kind))
            free = statistics.mean(times["free"])
            for kind in kinds[1:]:
                mean = statistics.mean(times[kind])
                row = {"case": kind if kind == "penalized" else f"json-schema/{backend}",
                       "batch": args.batch, "tokens": args.tokens, "rounds": args.rounds,
                       "free_step_ms": round(free, 3), "step_ms": round(mean, 3),
                       "ratio": round(mean / free, 3)}
                if kind == "constrained":
                    row["mask_us_per_seq"] = round(mask_us(llm, args.batch), 1)
                print(json.dumps(row), flush=True)
        finally:
            llm.shutdown()


if __name__ == "__main__":
    main()
