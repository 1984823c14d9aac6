"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) built from tensor-parallel layers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshserve.kernels import dispatch
from meshserve.kernels.dispatch import add_rms_norm, linear_swiglu, rms_norm, silu_and_mul
from meshserve.models.arch import ModelArch
from meshserve.models.attention import Attention, AttentionMetadata
from meshserve.models.moe import SparseMoeBlock
from meshserve.models.rope import RotaryEmbedding
from meshserve.parallel.comm.tp_group import SINGLE, TensorParallelGroup
from meshserve.parallel.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from meshserve.parallel.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from meshserve.parallel.layers.weights import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    """RMSNorm whose forward optionally folds in the residual add."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = set_weight_loader(
            nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False),
            default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, in `out_dtype`: default x's; new residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, out_dtype), x
        return add_rms_norm(x, residual, self.weight, self.eps, out_dtype)


class LlamaAttention(nn.Module):
    """Self-attention: fused QKV (column-parallel), rotary, paged attention, row-parallel out."""

    def __init__(self, arch: ModelArch, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        d = arch.head_dim
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, d, arch.num_attention_heads,
                                          arch.num_key_value_heads, bias=arch.qkv_bias, tp=tp,
                                          dtype=dtype)
        self.o_proj = RowParallelLinear(arch.num_attention_heads * d, arch.hidden_size,
                                        bias=arch.o_bias, tp=tp, dtype=dtype)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.head_dim = d
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, arch.sliding_window)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps, dtype) if arch.qk_norm else None

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata, act_dtype: torch.dtype | None = None,
                low: torch.dtype | None = None) -> torch.Tensor:
        """The block's output in `low` (default x's dtype): the dtype this step's linears
        compute in (dispatch.linear_dtype: bf16 in oneDNN), which o_proj's input is
        rounded to as well; q, k and v in `act_dtype` (default x's)."""
        t, h, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x, act_dtype).view(t, h + 2 * hkv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: each head normed
            q, k = qkv[:, :h], qkv[:, h:h + hkv]
            qkv[:, :h] = rms_norm(q, self.q_norm.weight, self.q_norm.eps, q.dtype)
            qkv[:, h:h + hkv] = rms_norm(k, self.k_norm.weight, self.k_norm.eps, k.dtype)
        out = self.attn.forward_qkv(qkv, *cos_sin, meta, low).reshape(t, h * self.head_dim)
        return self.o_proj(out, low or x.dtype)


class LlamaMLP(nn.Module):
    """SwiGLU MLP: merged gate/up (column-parallel), down (row-parallel)."""

    def __init__(self, arch: ModelArch, tp: TensorParallelGroup, dtype: torch.dtype,
                 inter: int | None = None) -> None:
        """`inter`: the SwiGLU width (default arch.intermediate_size)."""
        super().__init__()
        i = inter or arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [i, i],
                                                       bias=arch.mlp_bias, tp=tp, dtype=dtype)
        self.down_proj = RowParallelLinear(i, arch.hidden_size, bias=arch.mlp_bias, tp=tp,
                                           dtype=dtype)

    def forward(self, x: torch.Tensor, low: torch.dtype | None = None) -> torch.Tensor:
        """SwiGLU of x, each result in `low` (default x's dtype): the dtype this step's
        linears compute in (bf16 in oneDNN), which SwiGLU and the next RMSNorm read."""
        low = low or x.dtype
        up = self.gate_up_proj
        h = linear_swiglu(x, up.weight, up.bias, low)  # one pass where the bf16 kernels run
        return self.down_proj(silu_and_mul(up(x, low)) if h is None else h, low)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual is carried beside the hidden state."""

    def __init__(self, arch: ModelArch, tp: TensorParallelGroup, dtype: torch.dtype,
                 index: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, tp, dtype)
        self.mlp: LlamaMLP | SparseMoeBlock
        if arch.is_moe_layer(index):
            if tp.size != 1:
                raise ValueError(f"parallel.tp={tp.size}: the mixture-of-experts layers of "
                                 f"{arch.architecture} run on one rank for now; allowed: "
                                 "parallel.tp=1 (pipeline and data parallel layouts work)")
            shared = arch.shared_expert_intermediate_size
            self.mlp = SparseMoeBlock(
                arch, dtype, LlamaMLP(arch, tp, dtype, shared) if shared else None)
        else:
            self.mlp = LlamaMLP(arch, tp, dtype)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        act = x.dtype if residual is None else residual.dtype  # the residual stream's
        # The dtype every linear of this layer computes in, the same rows and weights'
        # kind for all: bf16 for a batch in oneDNN. The norms write it for them.
        low = dispatch.linear_dtype(x, self.self_attn.qkv_proj.weight)
        x, residual = self.input_layernorm(x, residual, low)
        x = self.self_attn(cos_sin, x, meta, act, low)
        x, residual = self.post_attention_layernorm(x, residual, low)
        return self.mlp(x, low), residual


LayerHook = Callable[[int, int], None]
"""hook(global layer index, tokens in the step), after the layer has run (enqueued, on a
GPU)."""


class LlamaModel(nn.Module):
    """The decoder stack, or one pipeline stage of it: layers [layer_start, layer_end)."""

    def __init__(self, arch: ModelArch, tp: TensorParallelGroup, dtype: torch.dtype,
                 layer_start: int, layer_end: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.layer_start, self.layer_end = layer_start, layer_end
        self.embed_tokens = (VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp=tp,
                                                    dtype=dtype)
                             if is_first or (is_last and arch.tie_word_embeddings) else None)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings,
                                      arch.rope_theta, arch.rope_scaling)
        # Keyed by the global layer index so parameter names match the checkpoint's.
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(arch, tp, dtype, i)
                                     for i in range(layer_start, layer_end)})
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype) if is_last else None
        self._layer_hooks: list[LayerHook] = []
        """Called after each layer with its global index and the step's token count (a
        prefill replica lists a streamed prompt's KV layer by layer:
        engine/kv_transfer/listing.py)."""

    def observe_layers(self, hook: LayerHook) -> None:
        """Call `hook` after each layer of every forward from now on."""
        self._layer_hooks.append(hook)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata, hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage 0 embeds `input_ids`; later stages continue from (hidden, residual)."""
        if self.is_first:
            assert self.embed_tokens is not None and input_ids is not None
            hidden = self.embed_tokens(input_ids)
        assert hidden is not None
        cos_sin = self.rotary.lookup(positions)
        hooks = self._layer_hooks
        for i, layer in enumerate(self.layers.values(), self.layer_start):
            hidden, residual = layer(cos_sin, hidden, residual, meta)
            for hook in hooks:
                hook(i, hidden.shape[0])
        if self.norm is not None:
            hidden, _ = self.norm(hidden, residual, None if residual is None else residual.dtype)
            residual = None
        elif residual is not None and hidden.dtype is not residual.dtype:
            hidden = hidden.to(residual.dtype)  # the next stage receives the model's dtype
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; serves LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM."""

    # checkpoint projection name -> (fused parameter name, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, arch: ModelArch, *, tp: TensorParallelGroup = SINGLE,
                 dtype: torch.dtype = torch.float32, layer_range: tuple[int, int] | None = None,
                 head_split: int | None = None) -> None:
        """`head_split` (a pipeline of TP size 1): the first stage holds the LM head's
        vocabulary rows [0, head_split), the last stage the rest."""
        super().__init__()
        self.arch = arch
        start, end = layer_range or (0, arch.num_hidden_layers)
        self.is_first, self.is_last = start == 0, end == arch.num_hidden_layers
        self.model = LlamaModel(arch, tp, dtype, start, end, self.is_first, self.is_last)
        self.lm_head: ParallelLMHead | None = None
        vocab = arch.vocab_size
        if head_split is not None:
            assert tp.size == 1 and 0 < head_split < vocab and not (self.is_first and self.is_last)
            if self.is_first or self.is_last:
                part = (0, head_split) if self.is_first else (head_split, vocab)
                self.lm_head = ParallelLMHead(vocab, arch.hidden_size, tp=tp, dtype=dtype,
                                              vocab_range=part)
        elif self.is_last:
            self.lm_head = ParallelLMHead(vocab, arch.hidden_size, tp=tp, dtype=dtype)
        if self.lm_head is not None and arch.tie_word_embeddings:
            assert self.model.embed_tokens is not None
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata, hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [T, hidden] (final-normed on the last stage) and the residual."""
        return self.model(input_ids, positions, meta, hidden, residual)

    def observe_layers(self, hook: LayerHook) -> None:
        """Call `hook(global layer index, tokens in the step)` after each layer runs."""
        self.model.observe_layers(hook)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, vocab] for the rows that sample (with a split head: this stage's part of
        the vocabulary), on TP rank 0; None on other TP ranks."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        """This stage's attention modules, in layer order (for binding KV caches)."""
        return [layer.self_attn.attn for layer in self.model.layers.values()]  # type: ignore[union-attr]
