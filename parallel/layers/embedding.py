"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous vocab range."""

from __future__ import annotations

import torch
from torch import nn

from meshserve.kernels import dispatch
from meshserve.parallel.comm.tp_group import SINGLE, TensorParallelGroup
from meshserve.parallel.layers.weights import LazyTensor, check_shape, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split over TP ranks; lookups are summed over the group."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TensorParallelGroup = SINGLE,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        # Pad so every rank holds the same number of rows; padded rows are never read.
        self.vocab_local = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_local
        self.vocab_end = min(self.vocab_start + self.vocab_local, vocab_size)
        self.weight = set_weight_loader(
            nn.Parameter(torch.zeros(self.vocab_local, hidden_size, dtype=dtype),
                         requires_grad=False),
            self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None) -> None:
        check_shape(loaded, (self.vocab_size, self.hidden_size))
        n = self.vocab_end - self.vocab_start
        param.data.narrow(0, 0, n).copy_(loaded.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return dispatch.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = dispatch.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection split over the vocabulary; full logits are gathered on TP rank 0
    only, the rank that samples.

    With `vocab_range` (TP size 1) it holds only those rows: a pipeline can split its head
    between the first and the last stage (see ParallelConfig.split_lm_head)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, bias: bool = False,
                 tp: TensorParallelGroup = SINGLE, dtype: torch.dtype | None = None,
                 vocab_range: tuple[int, int] | None = None) -> None:
        super().__init__(vocab_size, hidden_size, tp=tp, dtype=dtype)
        assert not bias, "LM-head bias is not used by the supported families"
        if vocab_range is not None:
            start, end = vocab_range
            assert tp.size == 1 and 0 <= start < end <= vocab_size, (tp.size, vocab_range)
            self.vocab_start, self.vocab_end = start, end
            self.vocab_local = end - start
            self.weight = set_weight_loader(
                nn.Parameter(torch.zeros(end - start, hidden_size, dtype=dtype),
                             requires_grad=False),
                self.weight_loader)

    @property
    def num_logits(self) -> int:
        """Logits per row this head returns (on TP rank 0)."""
        if self.tp.size == 1:
            return self.vocab_end - self.vocab_start
        return self.vocab_size

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): all of it, or this head's rows."""
        if self.vocab_local == embedding.vocab_local:
            self.weight = embedding.weight
        else:
            self.weight = nn.Parameter(embedding.weight.data[self.vocab_start:self.vocab_end],
                                       requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, num_logits] for the rows in `hidden` [N, hidden] on TP rank 0 (the full
        vocabulary, or this head's range); None on the other TP ranks (they only contribute
        their vocabulary shard)."""
        logits = self.tp.gather(dispatch.linear(hidden, self.weight), dim=-1, dst=0)
        return None if logits is None else logits[..., : self.num_logits]
