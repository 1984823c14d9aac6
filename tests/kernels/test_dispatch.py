"""The dispatcher's choice, and a whole model step through Triton (interpreter) vs reference."""

from __future__ import annotations

import pytest
import torch
from helpers.scheduled import Scheduled

from meshserve.engine.worker.model_runner import ModelRunner
from meshserve.kernels import dispatch
from meshserve.models.loader import load_model


def test_cpu_defaults_to_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch.kernel_mode.cache_clear()
    assert not dispatch.use_triton(torch.device("cpu"))
    assert dispatch.use_triton(torch.device("cuda")) == dispatch.triton_installed()
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    dispatch.kernel_mode.cache_clear()
    assert not dispatch.use_triton(torch.device("cuda"))
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    dispatch.kernel_mode.cache_clear()
    assert dispatch.use_triton(torch.device("cpu"))
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    dispatch.kernel_mode.cache_clear()
    with pytest.raises(ValueError, match="allowed are"):
        dispatch.use_triton(torch.device("cpu"))


STEPS = [
    # step 1: a whole prompt (20 tokens) and the first chunk (16) of a 30-token prompt
    [Scheduled(0, list(range(1, 21)), 0, [3, 0], True),
     Scheduled(1, list(range(40, 56)), 0, [5, 1], False)],
    # step 2: a decode (context 21) and the prompt's second chunk over its cached block
    [Scheduled(0, [7], 20, [3, 0]), Scheduled(1, list(range(56, 70)), 16, [5, 1])],
    # step 3: two decodes, one crossing into a new block
    [Scheduled(0, [8], 21, [3, 0]), Scheduled(1, [9], 30, [5, 1])],
]


def _logits(path, mode: str, monkeypatch: pytest.MonkeyPatch,
            kv_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    monkeypatch.setenv(dispatch.ENV_VAR, mode)
    dispatch.kernel_mode.cache_clear()
    model = load_model(path, dtype=torch.float32, progress=False)
    attn = model.attention_layers()[0]
    shape = (8, 16, attn.num_kv_heads, attn.head_dim)
    cache = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
             for _ in model.attention_layers()]
    runner = ModelRunner(model, cache, 16, torch.device("cpu"))
    return [runner.execute(step)[0] for step in STEPS]


@pytest.mark.parametrize("mode,kv_dtype", [
    ("triton", torch.float32), ("auto", torch.float32),  # auto on a CPU: the C kernels
    ("auto", torch.bfloat16)])  # an fp32 model over a bf16 cache (engine.kv_cache_dtype)
def test_model_steps_match_reference(make_checkpoint, monkeypatch: pytest.MonkeyPatch,
                                     mode: str, kv_dtype: torch.dtype) -> None:
    """Prefill, chunked prefill over a cached block, and decodes: same logits both ways."""
    path = make_checkpoint("llama", seed=3)
    ref = _logits(path, "reference", monkeypatch, kv_dtype)
    ours = _logits(path, mode, monkeypatch, kv_dtype)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if kv_dtype is not torch.float32:  # and the cache's rounding shows in the logits
        full = _logits(path, mode, monkeypatch)
        assert any(not torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(ours, full))
