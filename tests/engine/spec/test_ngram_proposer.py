"""Prompt-lookup drafts: the longest suffix match, its latest occurrence, what followed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshserve.engine.spec.ngram_proposer import NgramProposer


def test_the_longest_suffix_match_wins_and_the_latest_occurrence() -> None:
    p = NgramProposer(k=3, min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # Suffix 3-gram (2, 6, 7) has no earlier match; 2-gram (6, 7) occurs at 1 and 5:
    # the latest (5) is followed by 1, 2, 6.
    assert p.propose(tokens) == [1, 2, 6]
    assert p.propose([1, 2, 3, 1, 2, 3, 1, 2]) == [3, 1, 2]  # overlapping matches
    assert p.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert p.propose([9]) == []
    assert p.propose([4, 5, 4], k=1) == [5]


def test_the_draft_stops_where_the_sequence_ends() -> None:
    p = NgramProposer(k=4, min_n=2, max_n=2)
    assert p.propose([3, 4, 9, 3, 4]) == [9, 3, 4]
    assert NgramProposer(k=4, min_n=2, max_n=4).propose([1, 2, 1]) == []


def test_lookback_window_and_bad_settings() -> None:
    p = NgramProposer(k=2, min_n=1, max_n=2, max_lookback=4)
    assert p.propose([7, 8, 0, 0, 0, 1, 7]) == []  # the earlier 7 is out of reach
    with pytest.raises(ValueError, match="speculative.prompt_lookup_min"):
        NgramProposer(k=2, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="speculative.num_tokens"):
        NgramProposer(k=0)


def brute(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 5), st.integers(1, 3),
       st.integers(0, 3))
def test_matches_a_plain_search(tokens: list[int], k: int, min_n: int, extra: int) -> None:
    max_n = min_n + extra
    assert NgramProposer(k, min_n, max_n).propose(tokens) == brute(tokens, k, min_n, max_n)
