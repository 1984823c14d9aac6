"""meshserve's own costs beyond the math, measured: decode steps of random models through
the engine, less the time the cost model prices for their matmuls and memory traffic.

The layers are as wide as a small real model's (width 512, 11 MB of fp32 weights each):
streaming them evicts the caches between layers, as serving does, and the Python and
small-op work of every layer then runs cache-cold, which costs this CPU about twice what
it does on layers that fit in cache. Without a cluster to price the math, narrow (width 64)
layers make the math negligible instead.

Two depths (4 and 8 layers: one layer's 11 MB would stay in a 32 MB last-level cache from
step to step, and read faster than priced) and three batch sizes (1, 8 and 16 sequences)
separate the parts of t(L, B) - math(L, B) = step + B · step_seq + L · (layer + B · seq),
fitted in least squares: per step, per sequence per step, per layer, per sequence per
layer. On this project's CPUs most of it is per sequence per step (about 35 us: the
engine's Python work for each sequence), the same at 4 and 8 layers. The larger batches
are served ones: at 4 sequences the residual is mostly the matmuls' efficiency at 4 rows,
which a per-sequence term carries on to 64 sequences, where it priced meshcoder's decode
step at twice what the engine takes.
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file

from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.llm import LLM
from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.cost_model import CostModel, StepWork
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.placement import layout_for


class Shape(NamedTuple):
    """A calibration model's dimensions."""

    width: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


NARROW = Shape(64, 4, 2, 128, 256)
"""Math negligible: every cost is the runtime's (its caches stay warm)."""
WIDE = Shape(512, 8, 4, 1408, 256)
"""A small real model's layers (the bench's tiny): weights evict the caches between layers."""
DEPTHS = (4, 8)
BATCHES = (1, 8, 16)
PROMPT_LEN = 4


def tiny_checkpoint(path: Path, num_layers: int, seed: int = 0, shape: Shape = NARROW) -> Path:
    """A random fp32 Llama of `shape` as config.json + model.safetensors in `path`."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    width, heads, kv_heads, ffn, vocab = shape
    hd = width // heads

    def w(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen) * 0.05

    tensors = {"model.embed_tokens.weight": w(vocab, width), "lm_head.weight": w(vocab, width),
               "model.norm.weight": torch.ones(width)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(heads * hd, width),
                    p + "self_attn.k_proj.weight": w(kv_heads * hd, width),
                    p + "self_attn.v_proj.weight": w(kv_heads * hd, width),
                    p + "self_attn.o_proj.weight": w(width, heads * hd),
                    p + "mlp.gate_proj.weight": w(ffn, width), p + "mlp.up_proj.weight": w(ffn, width),
                    p + "mlp.down_proj.weight": w(width, ffn),
                    p + "input_layernorm.weight": torch.ones(width),
                    p + "post_attention_layernorm.weight": torch.ones(width)}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": width, "intermediate_size": ffn, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "tie_word_embeddings": False}))
    return path


def decode_step_s(model_dir: Path, device: str, tokens: int, batch: int) -> float:
    """Median time per output token of `batch` sequences decoding `tokens` tokens each."""
    overrides = [f"model.path={model_dir}", f"device={device}", "threads=1", "parallel=single",
                 "engine.enable_prefix_caching=false", "engine.kv_cache_memory=16777216"]
    with LLM(overrides=overrides, progress=False) as llm:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        prompts = [[1 + i, *range(2, PROMPT_LEN + 1)] for i in range(batch)]
        llm.generate(prompts, params)  # warm-up
        outs = [o for _ in range(2) for o in llm.generate(prompts, params)]
    return statistics.median(o.metrics.tpot for o in outs if o.metrics.tpot is not None)


Overheads = tuple[float, float, float, float]
"""(per step, per sequence per step, per layer, per sequence per layer), seconds or µs."""


def fit_overheads(t: dict[tuple[int, int], float]) -> Overheads:
    """Overheads that fit t[(layers, batch)] = step + batch · step_seq + layers · (layer +
    batch · seq) best in least squares, every point counted (one noisy time moves them less
    than a fit through differences does). The three costs that grow with the work are kept
    >= 0: the best fit over every subset of them (the others 0) whose terms all are. The
    constant is fitted free and then clipped at 0: on the CPU the math over-prices a step's
    fixed part by about 0.1 ms, and holding it at 0 during the fit would bend the rest."""
    points = sorted(t)
    rows = torch.tensor([[1.0, b, n, n * b] for n, b in points], dtype=torch.float64)
    want = torch.tensor([t[p] for p in points], dtype=torch.float64)
    best, best_err = [0.0] * 4, float("inf")
    for k in range(4):  # fewer terms first: a bigger subset must fit better to win
        for terms in itertools.combinations(range(1, 4), k):
            cols = [0, *terms]
            x = torch.linalg.lstsq(rows[:, cols], want.unsqueeze(1)).solution.squeeze(1)
            err = float((rows[:, cols] @ x - want).square().sum())
            if bool((x[1:] >= 0).all()) and err < best_err - 1e-18:
                best = [0.0] * 4
                for i, v in zip(cols, x.tolist()):
                    best[i] = v
                best_err = err
    return max(0.0, best[0]), best[1], best[2], best[3]


def math_s(model_dir: Path, cluster: ClusterConfig, tokens: int, batch: int) -> float:
    """The cost model's time for one of `model_dir`'s decode steps on one rank of `cluster`,
    with no overheads: matmuls, weight and KV reads, at the run's mean context."""
    arch = ModelArch.from_dir(model_dir)
    bare = replace(cluster, step_overhead_us=0.0, step_seq_overhead_us=0.0,
                   layer_overhead_us=0.0, seq_overhead_us=0.0)
    cost = CostModel(ModelShape.from_arch(arch, "float32"), bare,
                     layout_for(1, [(0, arch.num_hidden_layers)], 1, bare))
    return cost.step(StepWork.decode(batch, PROMPT_LEN + tokens / 2)).total_s


def runtime_overhead_us(device: str, tokens: int = 32, cluster: ClusterConfig | None = None
                        ) -> Overheads:
    """Overheads (µs) of the engine's decode here beyond `cluster`'s priced math (WIDE
    layers), or in all (NARROW layers) without a cluster."""
    shape = NARROW if cluster is None else WIDE
    with tempfile.TemporaryDirectory(prefix="meshserve-calibrate-") as tmp:
        dirs = {n: tiny_checkpoint(Path(tmp) / f"l{n}", n, shape=shape) for n in DEPTHS}
        t = {(n, b): decode_step_s(dirs[n], device, tokens, b) for n in DEPTHS for b in BATCHES}
        if cluster is not None:
            t = {(n, b): v - math_s(dirs[n], cluster, tokens, b) for (n, b), v in t.items()}
    step, step_seq, layer, seq = fit_overheads(t)
    return step * 1e6, step_seq * 1e6, layer * 1e6, seq * 1e6
