"""The benchmarks' random Llama checkpoints ('tiny', 'big', '120m', each also '-bf16'), built
once and cached on disk."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

_COMMON: dict[str, Any] = dict(vocab_size=32000, max_position_embeddings=4096)

SPECS: dict[str, dict[str, Any]] = {
    "tiny": dict(_COMMON, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4),
    "big": dict(_COMMON, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=8),
    "120m": dict(_COMMON, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}
SPECS.update({f"{name}-bf16": dict(spec, dtype="bfloat16") for name, spec in list(SPECS.items())})
"""Each also as `<name>-bf16`: the same random weights rounded to bf16 and saved so."""
"""LlamaConfig keyword arguments of each named checkpoint (docs/benchmarks/README.md, models)."""

SEED = 0
"""torch.manual_seed before the random init, so every machine builds the same weights."""

DEFAULT_CACHE_DIR = "~/.cache/meshserve/bench"
"""Where built checkpoints live, one folder per name."""


def build(path: str | Path, spec: dict[str, Any], seed: int = SEED) -> Path:
    """Save a random LlamaForCausalLM(LlamaConfig(**spec)) to `path` with save_pretrained:
    fp32, or rounded to spec["dtype"] (the same seed draws the same fp32 weights first)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(spec)
    dtype = spec.pop("dtype", "float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**spec, dtype="float32")).to(torch.float32).eval()
    if dtype != "float32":
        model.config.dtype = dtype
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    return Path(path)


def resolve(name_or_path: str, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """A model directory: an existing Hugging Face directory as is, or a named checkpoint.

    A named checkpoint is built under `cache_dir`/<name> on first use; it is written to a
    temporary folder and renamed into place, so an interrupted build never leaves a half
    checkpoint that later runs would take for a whole one.
    """
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    if name_or_path not in SPECS:
        raise ValueError(f"bench.model={name_or_path!r} is invalid: allowed is one of "
                         f"{sorted(SPECS)} or a Hugging Face model directory with config.json")
    target = Path(cache_dir).expanduser() / name_or_path
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name_or_path}-", dir=target.parent))
    try:
        build(tmp, SPECS[name_or_path])
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process's finished build
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
