"""Runs one scheduled step on this rank's model shard and KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshserve.engine.step_inputs import ScheduledLike, StepInputs, build_step_inputs
from meshserve.models.llama import LlamaForCausalLM


class ModelRunner:
    """Owns a model and its paged KV cache; turns scheduled sequences into logits."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        layers = model.attention_layers()
        assert len(layers) == len(kv_cache), (len(layers), len(kv_cache))
        for attn, (k, v) in zip(layers, kv_cache):
            attn.bind_cache(k, v)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write after a fork)."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k, v in self.kv_cache:
            k[dst] = k[src]
            v[dst] = v[src]

    @torch.inference_mode()
    def execute(self, seqs: Sequence[ScheduledLike]) -> tuple[torch.Tensor, list[int]]:
        """Logits [N, vocab] for the N sequences that sample, and their seq ids."""
        inputs = build_step_inputs(seqs, self.block_size, self.device)
        hidden = self.forward(inputs)
        if not inputs.sample_seq_ids:
            return hidden.new_empty(0, 0), []
        logits = self.model.compute_logits(hidden[inputs.sample_indices])
        return logits, inputs.sample_seq_ids

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states [T, hidden] of a single-stage model."""
        hidden, _ = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return hidden
