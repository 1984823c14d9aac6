"""Speculative decoding through a two-stage pipeline (parallel.pp=2, one thread a rank)
against the same pipeline without it, in one run.

One process holds one multi-rank LLM, so each side lives in a child process of its own
(with its stage-1 rank); the parent times them alternately, round by round, on the
bundled model's held-out standard-library prompts (draft) or its repeated-source prompts
(ngram), greedy, 128 new tokens, at least 10 sequences and three batches a run. A third side, none_again, is a second plain pipeline:
how far two alike ones differ in this run.
Usage: python spec_pp2.py draft|ngram [batch ...]
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection

TOKENS = 128
ROUNDS = 2
IDLE_S = 0.6
"""A pause before each timed run: the other sides' waiting ranks have backed off to idle
polls by then (after 0.5 s), instead of spinning beside the run."""


def side(conn: Connection, overrides: list[str], method: str) -> None:
    from meshserve import LLM, SamplingParams
    from meshserve.bench.speculative import heldout_prompts, prompts

    texts = heldout_prompts() if method == "draft" else prompts()
    sp = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM("meshcoder", overrides=["threads=1", "parallel.pp=2", *overrides],
              progress=False)
    conn.send([o.token_ids for o in llm.generate(texts, sp)])  # warm, and the outputs
    while (batch := conn.recv()) is not None:
        t0, n = time.perf_counter(), 0
        for i in range(0, max(len(texts), 3 * batch), batch):
            chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
            n += sum(len(o.token_ids) for o in llm.generate(chunk, sp))
        spec = llm.engine.stats.spec
        conn.send((n / (time.perf_counter() - t0), spec.num_draft_tokens,
                   spec.num_accepted_tokens, spec.num_drafts))
    llm.shutdown()


def main() -> None:
    method = sys.argv[1]
    batches = [int(b) for b in sys.argv[2:]] or [1, 4, 16]
    ctx = mp.get_context("spawn")
    sides = {"none": [], method: [f"speculative={method}"], "none_again": []}
    conns = {}
    for name, overrides in sides.items():
        parent, child = ctx.Pipe()
        ctx.Process(target=side, args=(child, overrides, method)).start()
        conns[name] = parent
    outs = {name: c.recv() for name, c in conns.items()}
    print(json.dumps({"layout": "parallel.pp=2", "method": method,
                      "identical": sum(a == b for a, b in zip(outs["none"], outs[method])),
                      "sequences": len(outs["none"])}), flush=True)
    for batch in batches:
        for c in conns.values():  # once untimed at this batch: the switch's first timings
            c.send(batch)
            c.recv()
        rates: dict[str, list[float]] = {n: [] for n in conns}
        before = after = None
        for r in range(ROUNDS):
            for name in list(conns) if r % 2 == 0 else list(conns)[::-1]:
                time.sleep(IDLE_S)
                conns[name].send(batch)
                got = conns[name].recv()
                rates[name].append(got[0])
                if name == method:
                    before = before or got
                    after = got
        mean = {n: statistics.mean(v) for n, v in rates.items()}
        assert before is not None and after is not None
        print(json.dumps({"batch": batch, "tokens": TOKENS, "rounds": ROUNDS,
                          **{f"{n}_tok_s": round(m, 1) for n, m in mean.items()},
                          f"{method}_over_none": round(mean[method] / mean["none"], 3),
                          "none_again_over_none": round(mean["none_again"] / mean["none"], 3),
                          "draft_tokens_total": after[1], "accepted_total": after[2],
                          "verify_steps_total": after[3]}), flush=True)
    for c in conns.values():
        c.send(None)


if __name__ == "__main__":
    main()
