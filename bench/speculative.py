"""Speculative decoding against none, and against transformers' prompt lookup, in one run.

    python -m meshserve.bench.speculative --tokens 128 --rounds 2 --batches 1 4 16 64

The workload is input-grounded: each prompt is a function from the Python standard
library followed by its own first lines again, so the completion repeats code the
prompt holds (what prompt lookup is for). The bundled model, greedy, EOS ignored, one
thread. Batch 1: every prompt alone, meshserve without and with n-gram drafts, and
transformers' `generate` without and with `prompt_lookup_num_tokens`; larger batches:
meshserve without and with drafts. Each figure is generated tokens per second over the
whole workload; rounds alternate which side goes first. Also the acceptance rate and the
mean tokens a verify step emitted.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections.abc import Callable

import torch

from meshserve.engine.llm import LLM
from meshserve.engine.sampling_params import SamplingParams
from meshserve.models.bundled import BUNDLED_DIR

SOURCES = ("textwrap.dedent", "json.decoder.py_scanstring", "shutil.copyfileobj",
           "fnmatch.translate", "string.capwords", "base64.b64encode", "calendar.monthrange",
           "textwrap.indent", "shutil.rmtree", "json.dumps")


def prompts() -> list[str]:
    """Each function's source (its first 30 lines), then its first two lines again (the
    model goes on)."""
    import importlib

    out = []
    for name in SOURCES:
        module, attr = name.rsplit(".", 1)
        lines = inspect.getsource(getattr(importlib.import_module(module), attr)).splitlines(
            keepends=True)
        src, head = "".join(lines[:30]), "".join(lines[:2])  # short enough for the context
        out.append(f"{src}\n\n# The same function again:\n{head}")
    return out


def rate(fn: Callable[[], int]) -> float:
    t0 = time.perf_counter()
    tokens = fn()
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--num-tokens", type=int, default=4, help="drafted tokens per step (k)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    texts = prompts()
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    base = ["parallel=single", "threads=1"]
    plain = LLM("meshcoder", overrides=base, progress=False)
    spec = LLM("meshcoder", overrides=[*base, "speculative=ngram",
                                       f"speculative.num_tokens={args.num_tokens}"],
               progress=False)
    from transformers import AutoModelForCausalLM

    from meshserve.models.tokenizer import Tokenizer

    tok = Tokenizer(BUNDLED_DIR / "meshcoder")
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_DIR / "meshcoder",
                                              dtype=torch.float32).eval()
    ids = [torch.tensor([tok.encode(t)]) for t in texts]

    def ours(llm: LLM, batch: int) -> Callable[[], int]:
        def run() -> int:
            n = 0
            for i in range(0, len(texts) * max(1, batch // len(texts)), batch):
                chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
                n += sum(len(o.token_ids) for o in llm.generate(chunk, sp))
            return n
        return run

    def theirs(lookup: int | None) -> Callable[[], int]:
        def run() -> int:
            n = 0
            with torch.no_grad():
                for x in ids:
                    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
                    out = hf.generate(x, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                      do_sample=False, **kw)
                    n += out.shape[1] - x.shape[1]
            return n
        return run

    # Warm every path, then check that greedy speculation changed no token.
    assert [o.token_ids for o in plain.generate(texts, sp)] == \
        [o.token_ids for o in spec.generate(texts, sp)], "speculation changed the output"
    theirs(args.num_tokens)()
    for batch in args.batches:
        sides: dict[str, Callable[[], int]] = {"none": ours(plain, batch),
                                               "ngram": ours(spec, batch)}
        if batch == 1:
            sides["transformers"] = theirs(None)
            sides["transformers-prompt-lookup"] = theirs(args.num_tokens)
        names = list(sides)
        rates: dict[str, list[float]] = {n: [] for n in names}
        before = spec.engine.stats.spec
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                rates[name].append(rate(sides[name]))
        after = spec.engine.stats.spec
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        steps = after.num_drafts - before.num_drafts
        mean = {n: statistics.mean(v) for n, v in rates.items()}
        row = {"batch": batch, "tokens": args.tokens, "rounds": args.rounds,
               **{f"{n}_tok_s": round(m, 1) for n, m in mean.items()},
               "ngram_over_none": round(mean["ngram"] / mean["none"], 3),
               "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
               "mean_tokens_per_verify": round((accepted + steps) / steps, 2) if steps else None}
        if batch == 1:
            row["ngram_over_transformers_prompt_lookup"] = round(
                mean["ngram"] / mean["transformers-prompt-lookup"], 3)
        print(json.dumps(row), flush=True)
    plain.shutdown()
    spec.shutdown()


if __name__ == "__main__":
    main()
