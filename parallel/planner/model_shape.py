"""The numbers of a decoder the cost model needs: parameters, FLOPs and bytes per layer.

`parallel/` knows nothing of `models/`: `ModelShape.from_arch` reads the few attributes it
needs from any object shaped like `models.arch.ModelArch` (duck typing, no import).
Per-rank figures follow the sharded layers: Q, MLP and vocabulary split over tp; K/V heads
split when tp divides them and replicated (one head per rank) when tp is a multiple.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from meshserve.validation import require

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ArchLike(Protocol):
    """What `ModelShape.from_arch` reads (models.arch.ModelArch has all of it, frozen)."""

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def tie_word_embeddings(self) -> bool: ...


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A Llama-family decoder's sizes and the dtype it runs in."""

    num_layers: int
    """Decoder layers."""
    hidden_size: int
    """Residual stream width d."""
    intermediate_size: int
    """MLP width f."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads."""
    head_dim: int
    """Per-head width."""
    vocab_size: int
    """Vocabulary size V."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    dtype: str = "bfloat16"
    """Weights and activations dtype (and the KV cache's unless `kv_dtype` says)."""
    kv_dtype: str | None = None
    """KV cache dtype (engine.kv_cache_dtype); None: `dtype`."""
    weight_dtype: str | None = None
    """What the weights are stored in when not `dtype` (model.cpu_weight_dtype: bf16 panels
    an fp32 model computes with); None: `dtype`."""

    def __post_init__(self) -> None:
        for n in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size"):
            require(getattr(self, n) >= 1, f"model.{n}", getattr(self, n), "an int >= 1")
        require(self.dtype in DTYPE_BYTES, "model.dtype", self.dtype, f"one of {tuple(DTYPE_BYTES)}")
        require(self.kv_dtype is None or self.kv_dtype in DTYPE_BYTES, "engine.kv_cache_dtype",
                self.kv_dtype, f"one of {tuple(DTYPE_BYTES)}")
        require(self.weight_dtype is None or self.weight_dtype in DTYPE_BYTES,
                "model.cpu_weight_dtype", self.weight_dtype, f"one of {tuple(DTYPE_BYTES)}")

    @classmethod
    def from_arch(cls, arch: ArchLike, dtype: str, kv_dtype: str | None = None,
                  weight_dtype: str | None = None) -> ModelShape:
        """From a ModelArch-like object, the dtype the model will run in, and its KV cache's
        and weights' (None: the same)."""
        return cls(num_layers=arch.num_hidden_layers, hidden_size=arch.hidden_size,
                   intermediate_size=arch.intermediate_size,
                   num_heads=arch.num_attention_heads, num_kv_heads=arch.num_key_value_heads,
                   head_dim=arch.head_dim, vocab_size=arch.vocab_size,
                   tie_word_embeddings=arch.tie_word_embeddings, dtype=dtype, kv_dtype=kv_dtype,
                   weight_dtype=weight_dtype)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of weights and activations."""
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_dtype_bytes(self) -> int:
        """Bytes per element of the stored weights."""
        return DTYPE_BYTES[self.weight_dtype or self.dtype]

    @property
    def kv_dtype_bytes(self) -> int:
        """Bytes per element of the KV cache."""
        return DTYPE_BYTES[self.kv_dtype or self.dtype]

    def kv_heads_per_rank(self, tp: int) -> int:
        """K/V heads each TP rank holds (replicated to one when tp exceeds them)."""
        return max(1, self.num_kv_heads // tp)

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one decoder layer on one TP rank."""
        d, hd = self.hidden_size, self.head_dim
        q_o = 2 * d * hd * self.num_heads // tp
        kv = 2 * d * hd * self.kv_heads_per_rank(tp)
        return q_o + kv + 3 * d * self.intermediate_size // tp + 2 * d

    def embed_params(self, tp: int = 1) -> int:
        """Input embedding parameters on one TP rank (vocabulary-parallel)."""
        return -(-self.vocab_size // tp) * self.hidden_size

    def head_params(self, tp: int = 1) -> int:
        """LM head (and final norm) parameters on one TP rank; the same matrix when tied."""
        return self.embed_params(tp) + self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters (embedding and LM head once when tied)."""
        head = self.hidden_size if self.tie_word_embeddings else self.head_params()
        return self.num_layers * self.layer_params() + self.embed_params() + head

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights."""
        return self.num_params * self.weight_dtype_bytes

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every weight but an untied input embedding
        (a decode gathers a few of its rows)."""
        embed = 0 if self.tie_word_embeddings else self.embed_params()
        return (self.num_params - embed) * self.weight_dtype_bytes

    def prefill_flops(self, num_tokens: int) -> float:
        """FLOPs of a whole prefill of `num_tokens` on one rank: the layers' matmuls, causal
        attention (each token attends to itself and those before), one LM-head row."""
        attended = num_tokens * (num_tokens + 1) / 2
        per_layer = self.layer_matmul_flops() * num_tokens + self.attention_flops(attended)
        return self.num_layers * per_layer + self.head_flops(1)

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """K and V bytes of one token in one layer on one TP rank."""
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim * self.kv_dtype_bytes

    def layer_matmul_flops(self, tp: int = 1) -> int:
        """Matmul FLOPs of one token through one decoder layer on one TP rank."""
        return 2 * (self.layer_params(tp) - 2 * self.hidden_size)

    def attention_flops(self, attended: float, tp: int = 1) -> float:
        """QK^T and PV FLOPs in one layer on one TP rank for `attended` (query, key) pairs."""
        return 4.0 * (self.num_heads // tp) * self.head_dim * attended

    def head_flops(self, num_rows: int, tp: int = 1) -> float:
        """LM-head FLOPs for `num_rows` logits rows on one TP rank."""
        return 2.0 * num_rows * self.embed_params(tp)

    def tp_error(self, tp: int) -> str | None:
        """Why this model can't be split `tp` ways, or None."""
        if self.num_heads % tp:
            return f"tp={tp} does not divide num_attention_heads={self.num_heads}"
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            return (f"tp={tp} neither divides nor is a multiple of "
                    f"num_key_value_heads={self.num_kv_heads}")
        if self.intermediate_size % tp:
            return f"tp={tp} does not divide intermediate_size={self.intermediate_size}"
        return None
