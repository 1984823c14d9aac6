"""A bf16 checkpoint on the CPU runs in bf16 by default: bf16 weights (the C panels, and
oneDNN's copy for batches where the CPU has bf16 instructions), a bf16 KV cache, fp32
activations where a kernel measures best so. Checked against transformers bf16 by
teacher-forced agreement and log-prob error; fp32 stays selectable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.engine.config.run import compute_dtype, cpu_weights, kv_cache_dtype, resolve_run
from meshserve.engine.config.runtime_config import load_runtime_config
from meshserve.kernels import dispatch
from meshserve.models.bundled import BUNDLED_DIR

ONE_RANK = ["parallel=single", "threads=1"]
PROMPTS = ["def fibonacci(n):", "import os\n\nclass Point:", "for i in range(10):",
           "def parse(line):", "# sort a list\n", "class Stack:", "def main():\n",
           "import numpy as np\n", "x = [", "while True:", "def merge(a, b):", "try:\n"]
AGREEMENT = 0.99
"""Teacher-forced top-1 agreement with transformers bf16 (the bar of the bf16 CPU path)."""


def resolved(*overrides: str, model: str = "model=meshcoder") -> tuple[str, torch.dtype,
                                                                       torch.dtype]:
    run = resolve_run(load_runtime_config([model, *ONE_RANK, *overrides]), env=None,
                      announce=False)
    return cpu_weights(run), compute_dtype(run), kv_cache_dtype(run)


@pytest.mark.skipif(not dispatch.native_enabled(), reason="the C kernels did not build")
def test_a_bf16_checkpoint_defaults_to_bf16_weights_and_cache() -> None:
    assert resolved() == ("bfloat16", torch.float32, torch.bfloat16)
    assert resolved("model.dtype=bfloat16") == ("bfloat16", torch.float32, torch.bfloat16)
    assert resolved("model.dtype=float32") == ("float32", torch.float32, torch.float32)
    assert resolved("model.cpu_weight_layout=row") == ("float32", torch.float32,
                                                        torch.bfloat16)
    assert resolved("engine.kv_cache_dtype=float32")[2] is torch.float32


def test_an_fp32_checkpoint_stays_fp32(make_checkpoint) -> None:
    path = make_checkpoint("llama")
    assert resolved(model=f"model.path={path}") == ("float32", torch.float32, torch.float32)


@pytest.fixture(scope="module")
def teacher() -> list[tuple[list[int], torch.Tensor]]:
    """transformers bf16's greedy continuation of each prompt (120 tokens) and its
    log-softmax at every position of it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(BUNDLED_DIR / "meshcoder")
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt")["input_ids"]
            seq = hf.generate(ids, max_new_tokens=120, do_sample=False, pad_token_id=0)[0]
            lp = hf(seq[None]).logits[0].float().log_softmax(-1)
            out.append((seq.tolist(), lp))
    return out


@pytest.mark.skipif(not dispatch.native_enabled(), reason="the C kernels did not build")
def test_bf16_mode_agrees_with_transformers_bf16(teacher) -> None:
    llm = LLM("meshcoder", overrides=ONE_RANK, progress=False)
    outs = llm.generate([s for s, _ in teacher],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    agree = total = 0
    errors = []
    for (seq, lp), o in zip(teacher, outs):
        assert o.prompt_logprobs is not None
        for pos in range(1, len(seq)):
            entry = o.prompt_logprobs[pos]
            assert entry is not None
            agree += max(entry, key=entry.__getitem__) == int(lp[pos - 1].argmax())
            total += 1
            errors.append(abs(entry[seq[pos]] - float(lp[pos - 1, seq[pos]])))
    err = torch.tensor(errors)
    print(f"bf16 mode: agreement {agree}/{total}, |d logprob| mean {err.mean():.4f} "
          f"max {err.max():.4f}")
    assert agree / total >= AGREEMENT
    assert err.mean() < 0.03 and err.max() < 0.25
