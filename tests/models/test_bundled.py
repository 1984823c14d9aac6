"""The bundled meshcoder pair: loads by short name, generates Python-looking text, and the
draft shares the target's tokenizer."""

from __future__ import annotations

import importlib.util
import json
import sys
from types import ModuleType

import pytest

from meshserve import LLM, SamplingParams
from meshserve.models.arch import ModelArch
from meshserve.models.bundled import BUNDLED_DIR, bundled_models, resolve_model_dir


def test_both_models_are_bundled_and_small() -> None:
    assert {"meshcoder", "meshcoder-draft"} <= set(bundled_models())
    total = sum(f.stat().st_size for f in BUNDLED_DIR.rglob("*") if f.is_file())
    assert total < 25 * 2**20
    target = ModelArch.from_dir(BUNDLED_DIR / "meshcoder")
    draft = ModelArch.from_dir(BUNDLED_DIR / "meshcoder-draft")
    assert 5e6 <= target.num_params <= 20e6
    assert 1 / 11 <= draft.num_params / target.num_params <= 1 / 7
    assert (BUNDLED_DIR / "meshcoder" / "tokenizer.json").read_bytes() == \
        (BUNDLED_DIR / "meshcoder-draft" / "tokenizer.json").read_bytes()


def test_training_report_is_written_down() -> None:
    report = json.loads((BUNDLED_DIR / "train_report.json").read_text())
    text = json.dumps(report)
    for key in ("agreement", "loss"):
        assert key in text


@pytest.mark.parametrize("name", ["meshcoder", "meshcoder-draft"])
def test_bundled_model_generates_code(name: str) -> None:
    llm = LLM(name, overrides=["parallel=single"], progress=False)
    out = llm.generate(["def fibonacci(n):", "import os\n\nclass "],
                       SamplingParams(max_tokens=32, temperature=0.0))
    for o in out:
        assert o.token_ids and o.text
    assert resolve_model_dir(name, None) == BUNDLED_DIR / name


def test_unknown_bundled_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"model\.name='nope' has no bundled weights"):
        resolve_model_dir("nope", None)


def _trainer() -> ModuleType:
    """models/bundled/train.py: a script beside the weights it made, not an installed module."""
    spec = importlib.util.spec_from_file_location("bundled_train", BUNDLED_DIR / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_target_has_learned_the_stdlib_and_the_draft_agrees() -> None:
    """Held-out stdlib code is far more predictable than chance (ln 4096 = 8.3 nats), and
    the recorded greedy agreement is what speculative decoding can build on."""
    import torch
    from transformers import AutoModelForCausalLM

    from meshserve.models.tokenizer import Tokenizer

    text = _trainer().collect_corpus().heldout[0]
    ids = Tokenizer(BUNDLED_DIR / "meshcoder").encode(text)[:256]
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_DIR / "meshcoder", dtype=torch.float32)
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert loss < 5.5, loss
    report = json.loads((BUNDLED_DIR / "train_report.json").read_text())
    assert report["agreement"]["agreement"] >= 0.5
    assert report["target"]["heldout_loss"] < 4.5 and report["draft"]["heldout_loss"] < 4.5
