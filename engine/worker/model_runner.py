"""Runs one scheduled step on this rank's model shard and KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshserve.engine.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from meshserve.engine.worker.sampling.prompt_logprobs import StepLogits, split_logits
from meshserve.engine.worker.sampling.sampled_tokens import SampledTokens, feed_placeholders
from meshserve.engine.worker.step_inputs import ScheduledLike, StepInputs, build_step_inputs
from meshserve.models.attention import AttentionMetadata
from meshserve.models.fused_decoder import FusedDecoder
from meshserve.models.llama import LlamaForCausalLM


class ModelRunner:
    """Owns a model and its paged KV cache; turns scheduled sequences into logits."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.graphs: DecodeGraphs | None = None
        layers = model.attention_layers()
        assert len(layers) == len(kv_cache), (len(layers), len(kv_cache))
        for attn, (k, v) in zip(layers, kv_cache):
            attn.bind_cache(k, v)
        self.fused = FusedDecoder.build(model)
        """The whole forward in one C call for decode-only steps, where it applies (one
        fp32 CPU shard with packed weights); None: the modules run every step."""

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
    def execute(self, seqs: Sequence[ScheduledLike], previous: SampledTokens | None = None
                ) -> tuple[torch.Tensor | None, list[int]]:
        """Logits [N, vocab] for the N sequences that sample (None on a rank without the
        LM head: another TP rank, an earlier stage), and their seq ids.

        A decode token that is PLACEHOLDER_TOKEN (async scheduling) is fed from `previous`,
        the step before, whose tokens may still be on the device only."""
        out = self.run_step(seqs, previous)
        return out.logits, out.seq_ids

    @torch.inference_mode()
    def run_step(self, seqs: Sequence[ScheduledLike], previous: SampledTokens | None = None
                 ) -> StepLogits:
        """`execute`'s logits, and those of the rows that score prompt tokens."""
        if self.graphs is not None and self.graphs.fits(seqs):
            return StepLogits(*self._execute_graph(seqs, previous))
        inputs = build_step_inputs(seqs, self.block_size, self.device)
        if inputs.meta.num_decode_tokens == inputs.num_decode_seqs:  # no drafts: row i is
            decodes = [seqs[i] for i in inputs.order[:inputs.num_decode_seqs]]  # decode i
            feed_placeholders(inputs.input_ids, decodes, previous)  # (drafts: never async)
        hidden = self.forward(inputs)
        if not inputs.num_logit_rows:
            return StepLogits(hidden.new_empty(0, 0), [])
        return split_logits(self.model.compute_logits(inputs.logit_rows(hidden)),
                            inputs.sample_seq_ids, inputs.prompt)

    def _execute_graph(self, seqs: Sequence[ScheduledLike], previous: SampledTokens | None
                       ) -> tuple[torch.Tensor | None, list[int]]:
        """A decode-only step under a captured graph, its inputs packed in one copy."""
        assert self.graphs is not None
        hidden = self.graphs.run_scheduled(
            seqs, self.block_size, lambda ids: feed_placeholders(ids, seqs, previous))
        rows = [i for i, s in enumerate(seqs) if s.sample]
        if not rows:
            return hidden.new_empty(0, 0), []
        if len(rows) < len(seqs):
            hidden = hidden[torch.tensor(rows, device=self.device)]
        return self.model.compute_logits(hidden), [seqs[i].seq_id for i in rows]

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode graphs at bucketed batch sizes (CUDA and Triton kernels only)."""
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self._eager, graph_batch_sizes(max_num_seqs), max_blocks,
                                   self.device)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states [T, hidden] of a single-stage model."""
        return self.forward_tokens(inputs.input_ids, inputs.positions, inputs.meta)

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """The same from tensors already built (a captured graph where one fits)."""
        if self.graphs is not None and self.graphs.can_run(meta):
            return self.graphs.run(input_ids, positions, meta)
        return self._eager(input_ids, positions, meta)

    def _eager(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        if self.fused is not None and self.fused.applies(meta):
            return self.fused.forward(input_ids, positions, meta)
        hidden, _ = self.model(input_ids, positions, meta)
        return hidden
