"""meshserve's own fixed costs, measured: decode steps of tiny random models through the
engine, where the math is negligible, so a step's time is the runtime's overhead.

Two depths (1 and 4 layers) and two batch sizes (1 and 4 sequences) separate the parts of
t(L, B) = step + L · (layer + B · seq): per step, per layer, per sequence per layer.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from meshserve.engine.llm import LLM
from meshserve.engine.sampling_params import SamplingParams

WIDTH, HEADS, KV_HEADS, FFN, VOCAB = 64, 4, 2, 128, 256
DEPTHS = (1, 4)
BATCHES = (1, 4)


def tiny_checkpoint(path: Path, num_layers: int, seed: int = 0) -> Path:
    """A random fp32 Llama of width 64 as config.json + model.safetensors in `path`."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    hd = WIDTH // HEADS

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    tensors = {"model.embed_tokens.weight": w(VOCAB, WIDTH), "lm_head.weight": w(VOCAB, WIDTH),
               "model.norm.weight": torch.ones(WIDTH)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(HEADS * hd, WIDTH),
                    p + "self_attn.k_proj.weight": w(KV_HEADS * hd, WIDTH),
                    p + "self_attn.v_proj.weight": w(KV_HEADS * hd, WIDTH),
                    p + "self_attn.o_proj.weight": w(WIDTH, HEADS * hd),
                    p + "mlp.gate_proj.weight": w(FFN, WIDTH), p + "mlp.up_proj.weight": w(FFN, WIDTH),
                    p + "mlp.down_proj.weight": w(WIDTH, FFN),
                    p + "input_layernorm.weight": torch.ones(WIDTH),
                    p + "post_attention_layernorm.weight": torch.ones(WIDTH)}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": WIDTH, "intermediate_size": FFN, "num_hidden_layers": num_layers,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "tie_word_embeddings": False}))
    return path


def decode_step_s(model_dir: Path, device: str, tokens: int, batch: int) -> float:
    """Median time per output token of `batch` sequences decoding `tokens` tokens each."""
    overrides = [f"model.path={model_dir}", f"device={device}", "threads=1", "parallel=single",
                 "engine.enable_prefix_caching=false", "engine.kv_cache_memory=16777216"]
    with LLM(overrides=overrides, progress=False) as llm:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        prompts = [[1 + i, 2, 3, 4] for i in range(batch)]
        llm.generate(prompts, params)  # warm-up
        outs = [o for _ in range(2) for o in llm.generate(prompts, params)]
    return statistics.median(o.metrics.tpot for o in outs if o.metrics.tpot is not None)


def fit_overheads(t: dict[tuple[int, int], float]) -> tuple[float, float, float]:
    """(step, layer, seq) seconds from t[(layers, batch)] at DEPTHS x BATCHES, clipped >= 0."""
    (l0, l1), (b0, b1) = DEPTHS, BATCHES
    per_layer = {b: (t[(l1, b)] - t[(l0, b)]) / (l1 - l0) for b in (b0, b1)}  # layer + b·seq
    seq = max(0.0, (per_layer[b1] - per_layer[b0]) / (b1 - b0))
    layer = max(0.0, per_layer[b0] - b0 * seq)
    step = max(0.0, t[(l0, b0)] - l0 * (layer + b0 * seq))
    return step, layer, seq


def runtime_overhead_us(device: str, tokens: int = 32) -> tuple[float, float, float]:
    """(per-step, per-layer, per-sequence-per-layer) µs of the engine's decode here."""
    with tempfile.TemporaryDirectory(prefix="meshserve-calibrate-") as tmp:
        dirs = {n: tiny_checkpoint(Path(tmp) / f"l{n}", n) for n in DEPTHS}
        t = {(n, b): decode_step_s(dirs[n], device, tokens, b) for n in DEPTHS for b in BATCHES}
    step, layer, seq = fit_overheads(t)
    return step * 1e6, layer * 1e6, seq * 1e6
