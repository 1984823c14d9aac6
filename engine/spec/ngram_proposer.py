"""Prompt-lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of
the sequence's own suffix.

The longest suffix of `min_n`..`max_n` tokens that occurred earlier in the sequence
(prompt and output) is found, and the k tokens that followed its most recent occurrence
are the draft (fewer if the sequence ends sooner). No match, no draft. One vectorised pass
finds where the last token occurred; each longer n only filters those positions, so the
cost is one comparison over the sequence, not one per n.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshserve.validation import require


class NgramProposer:
    """Drafts of up to `k` tokens from n-gram matches of `min_n`..`max_n` tokens."""

    def __init__(self, k: int, min_n: int = 1, max_n: int = 3,
                 max_lookback: int | None = None) -> None:
        """`max_lookback`: search only the latest this many tokens (None: all)."""
        require(k >= 1, "speculative.num_tokens", k, "an int >= 1")
        require(1 <= min_n <= max_n, "speculative.prompt_lookup_min", min_n,
                f"an int in [1, prompt_lookup_max={max_n}]")
        self.k, self.min_n, self.max_n, self.max_lookback = k, min_n, max_n, max_lookback

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int | None = None) -> list[int]:
        """The draft for a sequence whose tokens so far are `token_ids` (at most `k`, the
        proposer's own k by default)."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        if self.max_lookback is not None and len(tokens) > self.max_lookback:
            tokens = tokens[-self.max_lookback:]
        size = len(tokens)
        # ends: the positions i < size - 1 where the last n tokens occurred, ending at i;
        # n grows from 1 while any remain, and the longest n >= min_n gives the draft.
        ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1]) if size > 1 else tokens[:0]
        best, n = None, 1
        while ends.size:
            if n >= self.min_n:
                best = ends
            if n == self.max_n or n == size - 1:
                break
            n += 1
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[size - n]]
        if best is None:
            return []
        start = int(best[-1]) + 1  # what followed the latest occurrence
        return tokens[start:start + k].tolist()
