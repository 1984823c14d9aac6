"""A decoder's architecture, parsed from a Hugging Face config.json and validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                           "MixtralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


class CheckpointError(ValueError):
    """A model directory that can't be loaded; the message names the file and the problem."""


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    """The shape of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, and the
    mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral)."""

    architecture: str = "LlamaForCausalLM"
    """Hugging Face architecture name."""
    vocab_size: int
    """Vocabulary size (rows of the embedding)."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """MLP width."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA when fewer than query heads, MQA at 1)."""
    head_dim: int = 0
    """Per-head width; 0 means hidden_size // num_attention_heads."""
    max_position_embeddings: int = 4096
    """Longest context the model was trained for."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary base."""
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    """Rotary scaling parameters; rope_type in SUPPORTED_ROPE_TYPES."""
    qkv_bias: bool = False
    """Bias on the Q, K, V projections (Qwen2, Llama attention_bias)."""
    o_bias: bool = False
    """Bias on the output projection (Llama attention_bias)."""
    mlp_bias: bool = False
    """Bias on the MLP projections."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key (a weight of head_dim each) before rotary
    (Qwen3)."""
    num_experts: int = 0
    """Experts of a mixture-of-experts MLP (0: every layer's MLP is dense)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Each expert's SwiGLU width."""
    norm_topk_prob: bool = False
    """Renormalize the top-k routing weights to sum 1."""
    decoder_sparse_step: int = 1
    """Layer i's MLP is the experts where (i + 1) % decoder_sparse_step == 0..."""
    mlp_only_layers: tuple[int, ...] = ()
    """...and i is not listed here (dense MLP layers)."""
    shared_expert_intermediate_size: int = 0
    """Width of a shared expert every token also takes, behind a sigmoid gate (Qwen2-MoE);
    0: none."""

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is the mixture of experts (Qwen3-MoE's rule)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    sliding_window: int | None = None
    """Attend to at most this many previous tokens (Mistral)."""
    dtype: str = "float32"
    """The checkpoint's dtype."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence tokens."""

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        rope_type = self.rope_scaling.get("rope_type", "default")
        checks = [
            (self.architecture in SUPPORTED_ARCHITECTURES, "architectures", self.architecture,
             f"one of {SUPPORTED_ARCHITECTURES}"),
            (self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             self.num_key_value_heads, f"a divisor of num_attention_heads={self.num_attention_heads}"),
            (rope_type in SUPPORTED_ROPE_TYPES, "rope_scaling.rope_type", rope_type,
             f"one of {SUPPORTED_ROPE_TYPES}"),
            (self.dtype in SUPPORTED_DTYPES, "torch_dtype", self.dtype, f"one of {SUPPORTED_DTYPES}"),
        ]
        for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim"):
            checks.append((getattr(self, n) >= 1, n, getattr(self, n), "an int >= 1"))
        if self.num_experts:
            checks += [
                (1 <= self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                 self.num_experts_per_tok, f"an int in [1, num_experts={self.num_experts}]"),
                (self.moe_intermediate_size >= 1, "moe_intermediate_size",
                 self.moe_intermediate_size, "an int >= 1"),
                (self.decoder_sparse_step >= 1, "decoder_sparse_step",
                 self.decoder_sparse_step, "an int >= 1")]
        for ok, name, value, allowed in checks:
            if not ok:
                raise CheckpointError(f"config field {name}={value!r} is not supported: "
                                      f"allowed is {allowed}")

    @property
    def num_params(self) -> int:
        """Parameter count (embedding and LM head counted once when tied)."""
        d, h = self.hidden_size, self.head_dim
        attn = d * h * (self.num_attention_heads + 2 * self.num_key_value_heads)
        attn += self.num_attention_heads * h * d
        layer = attn + 3 * d * self.intermediate_size + 2 * d + (2 * h if self.qk_norm else 0)
        moe = self.num_experts * (3 * d * self.moe_intermediate_size + d)
        moe += 3 * d * self.shared_expert_intermediate_size + (
            d if self.shared_expert_intermediate_size else 0)
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return (self.num_hidden_layers * layer + emb + d
                + moe_layers * (moe - 3 * d * self.intermediate_size))

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelArch:
        """Build from a Hugging Face config dict; errors name `source` and the field."""
        archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"{source}: architecture {arch!r} is not supported; "
                                  f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if missing:
            raise CheckpointError(f"{source}: missing required field(s) {missing}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = cfg.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                    "Qwen2MoeForCausalLM") and not cfg.get(
                "use_sliding_window", False):
            window = None
        attention_bias = bool(cfg.get("attention_bias", False))
        try:
            return cls(
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=cfg["num_attention_heads"],
                num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                head_dim=cfg.get("head_dim") or 0,
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=rope if rope.get("rope_type", "default") != "default" else {},
                qkv_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or attention_bias,
                o_bias=attention_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
                num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or (
                    cfg["intermediate_size"] if arch == "MixtralForCausalLM" else 0)),
                norm_topk_prob=arch == "MixtralForCausalLM" or bool(
                    cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(
                    cfg.get("shared_expert_intermediate_size") or 0),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                sliding_window=window,
                dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelArch:
        """Read `path`/config.json."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path}: missing file (a Hugging Face model directory "
                                  "needs config.json)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(cfg, str(cfg_path))


_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "mixtral": "MixtralForCausalLM"}
