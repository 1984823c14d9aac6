"""A Llama-family model's decode-row forward in one C call on the CPU (decoder.c).

A decode step of a small model spends more time in Python around its kernels than in
them (the bundled pair's figures: docs/benchmarks/2026-12-05-cpu-2core.md). Where every
row of a step is a decode row (plain decodes, a verify step's rows, a draft model's lean
steps) and the model is one fp32 CPU shard with packed weights, the runner calls
`FusedDecoder.forward` instead of the modules: the same kernels in the same order, so
the hidden states are bit-identical to the modules' (tests/models/test_fused_decoder.py).
"""

from __future__ import annotations

import ctypes

import torch

from meshserve.kernels import dispatch, native_cpu
from meshserve.kernels.dispatch import packed_columns
from meshserve.models.attention import AttentionMetadata
from meshserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

LINEARS = ("qkv", "o", "gate_up", "down")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecoder:
    """The C view of a bound model: pointers to its weights and KV caches."""

    def __init__(self, model: LlamaForCausalLM, layers: list[LlamaDecoderLayer]) -> None:
        inner = model.model
        assert inner.embed_tokens is not None and inner.norm is not None
        attn = layers[0].self_attn
        mlp = layers[0].mlp
        self.weight_dtype = attn.qkv_proj.weight.dtype
        """What the packed panels hold (fp32, or bf16: model.cpu_weight_dtype)."""
        self.bf16_batches = dispatch.batches_in_bf16(attn.qkv_proj.weight)
        """Whether the modules run batches with bf16 activations (dispatch.BF16_ROWS)."""
        structs = []
        for layer in layers:
            a, f = layer.self_attn, layer.mlp
            if not isinstance(f, LlamaMLP):  # the C decoder has no mixture of experts
                return None
            mods = {"qkv": a.qkv_proj, "o": a.o_proj, "gate_up": f.gate_up_proj,
                    "down": f.down_proj}
            structs.append(native_cpu.DecoderLayerStruct(
                input_norm=_ptr(layer.input_layernorm.weight),
                post_norm=_ptr(layer.post_attention_layernorm.weight),
                **{name: _ptr(mod.weight) for name, mod in mods.items()},
                **{f"{name}_bias": _ptr(mod.bias) for name, mod in mods.items()},
                k_cache=_ptr(a.attn.k_cache), v_cache=_ptr(a.attn.v_cache)))
        self._layers = (native_cpu.DecoderLayerStruct * len(structs))(*structs)
        rotary = inner.rotary
        arch = model.arch
        self.struct = native_cpu.DecoderStruct(
            num_layers=len(layers), hidden=arch.hidden_size, heads=attn.num_heads,
            kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=mlp.down_proj.in_local, block_size=attn.attn.k_cache.shape[1],
            window=attn.attn.sliding_window or 0,
            kv_bf16=native_cpu.kv_bf16(attn.attn.k_cache),
            weights_bf16=self.weight_dtype is torch.bfloat16, eps=layers[0].input_layernorm.eps,
            scale=attn.attn.scale, embed=_ptr(inner.embed_tokens.weight),
            embed_packed=packed_columns(inner.embed_tokens.weight) is not None,
            cos=_ptr(rotary.cos), sin=_ptr(rotary.sin), final_norm=_ptr(inner.norm.weight),
            layers=ctypes.cast(self._layers, ctypes.POINTER(native_cpu.DecoderLayerStruct)))

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> FusedDecoder | None:
        """The fused view of `model` with its caches bound, or None where it does not
        apply: not one fp32 CPU shard with packed weights and the C kernels, a pipeline
        stage, layers that differ in their attention window or epsilon, or q/k norms."""
        inner = model.model
        layers = [m for m in inner.layers.values() if isinstance(m, LlamaDecoderLayer)]
        if (not layers or not (model.is_first and model.is_last)
                or inner.embed_tokens is None or inner.norm is None):
            return None
        embed = inner.embed_tokens.weight
        tensors = [inner.norm.weight, inner.rotary.cos]
        packed = [embed] if packed_columns(embed) is not None else []
        tensors += [] if packed else [embed]
        first = layers[0]
        for layer in layers:
            a, f = layer.self_attn, layer.mlp
            if not isinstance(f, LlamaMLP):  # the C decoder has no mixture of experts
                return None
            linears = (a.qkv_proj, a.o_proj, f.gate_up_proj, f.down_proj)
            if any(mod.tp.size != 1 or packed_columns(mod.weight) is None
                   for mod in linears):
                return None
            packed += [mod.weight for mod in linears]
            tensors += [mod.bias for mod in linears if mod.bias is not None]
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            caches = (a.attn.k_cache, a.attn.v_cache)
            if (not caches[0].numel() or not dispatch.native_kv(*caches)
                    or caches[0].dtype != first.self_attn.attn.k_cache.dtype):
                return None
            if a.q_norm is not None:  # the C decoder does not norm q and k per head
                return None
            if (a.attn.sliding_window != first.self_attn.attn.sliding_window
                    or layer.input_layernorm.eps != first.input_layernorm.eps
                    or layer.post_attention_layernorm.eps != first.input_layernorm.eps):
                return None
        if (inner.norm.eps != layers[0].input_layernorm.eps
                or not all(t.is_contiguous() and t.numel() for t in tensors + packed)
                or not dispatch.use_native(*tensors)
                or len({w.dtype for w in packed}) != 1
                or not dispatch.native_panels(packed[0])):
            return None
        return cls(model, layers)

    def applies(self, meta: AttentionMetadata) -> bool:
        """Whether this step's rows are all decode rows, with int64 metadata, and small
        few enough that the modules would run their linears in the C panels too
        (`_in_panels`)."""
        if meta.prefills or meta.num_decode_tokens == 0:
            return False
        if not self._in_panels(meta.num_decode_tokens):
            return False
        return all(t.dtype is torch.int64 and t.is_contiguous() and t.is_cpu for t in (
            meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens))

    def drafts_greedy(self, head: torch.Tensor, vocab: int, rows: int) -> bool:
        """Whether `draft_greedy` can run `rows` rows with this LM head: packed in the
        layers' weight dtype, all `vocab` logits on this rank, and rows few enough for one
        thread (`applies`)."""
        return (packed_columns(head) == vocab and head.is_cpu
                and head.dtype is self.weight_dtype and self._in_panels(rows))

    def _in_panels(self, rows: int) -> bool:
        """Whether the modules would run every linear of `rows` rows in the C panels (not
        bf16 activations: dispatch.BF16_ROWS), as the fused call does (on as many threads)."""
        return not (self.bf16_batches and rows >= dispatch.BF16_ROWS)

    def draft_greedy(self, head: torch.Tensor, drafted: torch.Tensor, start: torch.Tensor,
                     block_tables: torch.Tensor, wanted: torch.Tensor,
                     feed_tokens: torch.Tensor | None = None,
                     feed_counts: torch.Tensor | None = None) -> None:
        """A draft model's greedy drafts in one C call (drafts_greedy said yes) into
        drafted [B, k]: with `feed_tokens` (flat) and `feed_counts` [B] each row first
        feeds its tokens as decode rows from position start[r] and drafts from the last;
        without, drafted[:, 0] holds each row's first draft and start[r] its last known
        token's position. Row r wants wanted[r] drafts. The same drafts as the modules'
        steps with dispatch.argmax_rows."""
        n = packed_columns(head)
        assert n is not None
        self.struct.threads = torch.get_num_threads()
        native_cpu.decoder_draft_greedy(self.struct, head, n, drafted, start, block_tables,
                                        wanted, feed_tokens, feed_counts)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] of a step `applies` accepted."""
        ids = input_ids if input_ids.dtype is torch.int64 else input_ids.long()
        pos = positions if positions.dtype is torch.int64 else positions.long()
        self.struct.threads = torch.get_num_threads()  # the linears' share of the pool
        return native_cpu.decoder_forward(self.struct, ids.contiguous(), pos.contiguous(),
                                          meta.slot_mapping, meta.decode_block_tables,
                                          meta.decode_context_lens)
