"""Prompt-lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of
the sequence's own suffix.

For n from `max_n` down to `min_n`, the last n tokens are looked for earlier in the
sequence (prompt and output); at the first n with a match, the k tokens that followed the
most recent match are the draft (fewer if the sequence ends sooner). No match, no draft.
The search is vectorised over the sequence with numpy: no Python loop per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = tokens[size - n:]
            # Window i is tokens[i:i + n], i < size - n: it starts before the suffix and a
            # token follows it.
            windows = sliding_window_view(tokens[:size - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
