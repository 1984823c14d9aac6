"""Speculative decoding against none, and against transformers' assisted generation and
prompt lookup, in one run.

    python -m meshserve.bench.speculative --method ngram --tokens 128 --rounds 2 --batches 1 4 16 64
    python -m meshserve.bench.speculative --method draft --tokens 128 --rounds 2 --batches 1 4 16 64

`--method ngram` runs an input-grounded workload: each prompt is a function from the
Python standard library followed by its own first lines again, so the completion repeats
code the prompt holds (what prompt lookup is for). `--method draft` runs the bundled
model's held-out standard-library files (never trained on), a window of lines from each,
with the bundled draft. The bundled model, greedy, EOS ignored, one thread. Batch 1:
every prompt alone, meshserve without and with drafts, and transformers' `generate`
without drafts, with `prompt_lookup_num_tokens` and (draft) with `assistant_model=` the
same draft; larger batches: meshserve without and with drafts. Each figure is generated
tokens per second over the whole workload; rounds alternate which side goes first, after
one untimed pass of each meshserve side at that batch size (kernels compiled for its
shapes, the switch's first timings taken, as in a service already running). Also the
acceptance rate, the mean tokens a verify step emitted, and how the switch timed the
batch size's drafted and plain steps.

`--device cuda --dtype bfloat16` runs both sides and the peers on a GPU (meshserve with
CUDA graphs and async scheduling; the speculating engine schedules its plain steps
asynchronously and waits only before a step that drafts). Before timing, the run reports how far greedy
speculation kept to plain decoding (`greedy_identity`); on a CPU it must be identical.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import statistics
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.llm import LLM
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


SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "encodings",
                       "pydoc_data", "__pycache__"})
"""The directories the bundled models' training skipped (models/bundled/train.py)."""


def heldout_prompts(num: int = 10, num_lines: int = 14) -> list[str]:
    """Windows of `num_lines` lines from the standard-library files the bundled models
    held out of training (sha256 of the relative path % 100 < 2): two per file, from a
    third and two thirds of the way in, skipping files too short for them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        if int(hashlib.sha256(rel.as_posix().encode()).hexdigest(), 16) % 100 >= 2:
            continue
        lines = path.read_text(errors="replace").splitlines(keepends=True)
        if len(lines) < 4 * num_lines:
            continue
        for at in (len(lines) // 3, 2 * len(lines) // 3):
            out.append("".join(lines[at:at + num_lines]))
    return out[:num]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def identity(plain: list[list[int]], spec: list[list[int]]) -> dict[str, float]:
    """How far greedy speculation kept to plain decoding: sequences identical, and the
    share of tokens before each sequence's first difference. On a GPU the verify step's
    k + 1 rows take other kernels than a decode's one, so near-ties may round apart."""
    prefix = []
    for a, b in zip(plain, spec, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(1, len(a)))
    return {"sequences": len(plain), "identical": sum(a == b for a, b in zip(plain, spec)),
            "tokens_before_first_difference": round(statistics.mean(prefix), 4)}


def rate(fn: Callable[[], int]) -> float:
    sync()
    t0 = time.perf_counter()
    tokens = fn()
    sync()
    return tokens / (time.perf_counter() - t0)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--num-tokens", type=int, default=4, help="drafted tokens per step (k)")
    ap.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    ap.add_argument("--prompts", type=int, default=10, help="prompts of the workload (<= 10)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    ap.add_argument("--control", action="store_true",
                    help="also a second plain engine (none_again): how far two alike "
                         "engines differ in this run")
    ap.add_argument("--no-peers", action="store_true",
                    help="meshserve with and without drafts only (no transformers runs)")
    ap.add_argument("--step-log", default=None, metavar="FILE",
                    help="the speculating engine's step records (for `meshserve diagnose`)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    method, device, dtype = args.method, torch.device(args.device), DTYPES[args.dtype]
    texts = prompts() if method == "ngram" else heldout_prompts()
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    base = ["parallel=single", "threads=1", f"device={device.type}", f"model.dtype={args.dtype}"]
    if device.type == "cuda":  # two engines share the GPU: a cache for the largest batch each
        base += ["engine.num_gpu_blocks=4096", f"engine.max_num_seqs={max(args.batches)}"]
    texts = texts[:args.prompts]
    plain = LLM("meshcoder", overrides=base, progress=False)
    again = LLM("meshcoder", overrides=base, progress=False) if args.control else None
    log = [f"engine.step_log='{args.step_log}'"] if args.step_log else []
    spec = LLM("meshcoder", overrides=[*base, f"speculative={method}",
                                       f"speculative.num_tokens={args.num_tokens}", *log],
               progress=False)
    from transformers import AutoModelForCausalLM

    from meshserve.models.tokenizer import Tokenizer

    tok = Tokenizer(BUNDLED_DIR / "meshcoder")
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_DIR / "meshcoder",
                                              dtype=dtype).eval().to(device)
    hf_draft = AutoModelForCausalLM.from_pretrained(BUNDLED_DIR / "meshcoder-draft",
                                                    dtype=dtype).eval().to(device)
    ids = [torch.tensor([tok.encode(t)], device=device) for t in texts]

    def ours(llm: LLM, batch: int) -> Callable[[], int]:
        def run() -> int:
            n = 0
            for i in range(0, len(texts) * max(1, batch // len(texts)), batch):
                chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
                n += sum(len(o.token_ids) for o in llm.generate(chunk, sp))
            return n
        return run

    def theirs(**kw: object) -> Callable[[], int]:
        def run() -> int:
            n = 0
            with torch.no_grad():
                for x in ids:
                    out = hf.generate(x, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                      do_sample=False, **kw)
                    n += out.shape[1] - x.shape[1]
            return n
        return run

    # Warm every path, then check that greedy speculation changed no token.
    same = identity([o.token_ids for o in plain.generate(texts, sp)],
                    [o.token_ids for o in spec.generate(texts, sp)])
    print(json.dumps({"greedy_identity": same, "device": device.type, "dtype": args.dtype}),
          flush=True)
    assert device.type != "cpu" or same["identical"] == same["sequences"], \
        "speculation changed the output"
    lookup = theirs(prompt_lookup_num_tokens=args.num_tokens)
    assisted = theirs(assistant_model=hf_draft, num_assistant_tokens=args.num_tokens,
                      num_assistant_tokens_schedule="constant")
    if not args.no_peers:
        lookup()
        if method == "draft":
            assisted()
    for batch in args.batches:
        sides: dict[str, Callable[[], int]] = {"none": ours(plain, batch),
                                               method: ours(spec, batch)}
        if again is not None:
            sides["none_again"] = ours(again, batch)
        if batch == 1 and not args.no_peers:
            sides["transformers"] = theirs()
            sides["transformers-prompt-lookup"] = lookup
            if method == "draft":
                sides["transformers-assisted"] = assisted
        names = list(sides)
        rates: dict[str, list[float]] = {n: [] for n in names}
        # Each meshserve side once untimed at this batch size: kernels compiled for its
        # shapes, the switch's first timings taken, as in a service already running
        # (the peers were warmed above).
        for name in ("none", method, "none_again"):
            if name in sides:
                sides[name]()
        before = spec.engine.stats.spec
        switch = spec.engine.scheduler.switch
        steps_before = (switch.num_drafted_steps, switch.num_plain_steps) if switch else (0, 0)
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
               f"{method}_over_none": round(mean[method] / mean["none"], 3),
               **({"none_again_over_none": round(mean["none_again"] / mean["none"], 3)}
                  if "none_again" in mean else {}),
               "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
               "mean_tokens_per_verify": round((accepted + steps) / steps, 2) if steps else None}
        if switch is not None:  # how the run-time switch priced this batch size's steps
            d_s, p_s = switch.step_seconds(batch)
            row["switch"] = {
                "drafted_steps": switch.num_drafted_steps - steps_before[0],
                "plain_steps": switch.num_plain_steps - steps_before[1],
                "drafted_step_ms": round(d_s * 1e3, 3) if d_s else None,
                "plain_step_ms": round(p_s * 1e3, 3) if p_s else None}
        if batch == 1:
            for peer in ("transformers-prompt-lookup", "transformers-assisted"):
                if peer in mean:
                    row[f"{method}_over_{peer.replace('-', '_')}"] = round(
                        mean[method] / mean[peer], 3)
        print(json.dumps(row), flush=True)
    for llm in (plain, spec, again):
        if llm is not None:
            llm.shutdown()


if __name__ == "__main__":
    main()
