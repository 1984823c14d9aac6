"""What a prefill replica lists of a streamed prompt, layer by layer, and the reads a decode
replica makes of it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshserve.engine.kv_transfer.listing import Listed, StreamLister, moves


def test_listed_round_trips_and_says_each_blocks_layers() -> None:
    listed = Listed([7, 3, 9, 4], full=2, layers=5)
    assert Listed.from_json(listed.to_json()) == listed
    assert [listed.layers_of(i, 8) for i in range(6)] == [8, 8, 5, 5, 0, 0]


def test_moves_group_blocks_that_lack_the_same_layers() -> None:
    assert moves([8, 3, 3, 0, 0, 0], [8, 8, 8, 5, 5, 0]) == [(1, 3, 3, 8), (3, 5, 0, 5)]
    assert moves([0, 0], [0, 0]) == []
    assert moves([2, 0, 2], [4, 4, 4]) == [(0, 1, 2, 4), (1, 2, 0, 4), (2, 3, 2, 4)]


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=20))
def test_moves_bring_every_block_to_what_it_wants_once(pairs: list[tuple[int, int]]) -> None:
    have, want = [h for h, _ in pairs], [w for _, w in pairs]
    got = list(have)
    for start, stop, lo, hi in moves(have, want):
        assert start < stop and lo < hi
        for i in range(start, stop):
            assert got[i] == lo  # nothing read twice, nothing skipped
            got[i] = hi
    assert got == [max(h, w) for h, w in pairs]


class _Prefill:
    """A prefill replica's side of a lister: what it pins and publishes."""

    def __init__(self, num_layers: int = 3) -> None:
        self.pins: list[int] = []
        self.published: list[tuple[int, dict[int, Listed]]] = []
        self.lister = StreamLister((0, num_layers), lambda dst, listed: self.published.append(
            (dst, dict(listed))), cuda=False)

    def step(self, tokens: int, after: dict[str, list[int]], preempted: bool = False,
             last: tuple[str, ...] = ()) -> None:
        """A step that completes `after[rid]` of each prompt and ends those in `last`."""
        self.lister.launched(tokens, lambda rid: (after.get(rid, []), int(preempted),
                                                  rid in last), self.pins.extend)

    def forward(self, tokens: int) -> None:
        for layer in range(self.lister.last + 1):
            self.lister.layer_done(layer, tokens)

    def last(self, dst: int = 1) -> dict[int, Listed]:
        return next(listed for d, listed in reversed(self.published) if d == dst)


def test_the_step_that_ends_a_prompt_lists_it_layer_by_layer(monkeypatch) -> None:
    monkeypatch.setattr("meshserve.engine.kv_transfer.listing.LIST_EVERY_S", 0.0)
    p = _Prefill()
    p.lister.add("a", transfer_id=11, decode=1)
    p.step(16, {"a": [5, 6]})  # the step completes blocks 5 and 6, the prompt goes on
    assert p.pins == [5, 6] and not p.published  # pinned before it runs, listed after
    p.lister.layer_done(0, 16)
    p.lister.layer_done(1, 16)
    assert not p.published  # (the next steps leave time to read it)
    p.lister.layer_done(2, 16)
    assert p.published == [(1, {11: Listed([5, 6], full=2, layers=0)})]
    p.step(12, {"a": [5, 6, 2]}, last=("a",))  # the last step: block 2, then the tail
    p.lister.layer_done(0, 12)
    assert p.last() == {11: Listed([5, 6, 2], full=2, layers=1)}
    p.lister.layer_done(1, 12)
    assert p.last() == {11: Listed([5, 6, 2], full=2, layers=2)}
    p.lister.layer_done(2, 12)
    assert p.last() == {11: Listed([5, 6, 2], full=3, layers=0)}
    assert p.pins == [5, 6, 2]


def test_another_prompts_last_step_lists_only_its_own_layer_by_layer(monkeypatch) -> None:
    monkeypatch.setattr("meshserve.engine.kv_transfer.listing.LIST_EVERY_S", 0.0)
    p = _Prefill()
    p.lister.add("a", 11, 1)
    p.lister.add("b", 12, 1)
    p.step(24, {"a": [5], "b": [8]}, last=("b",))
    p.lister.layer_done(0, 24)
    assert p.last() == {12: Listed([8], full=0, layers=1)}  # a's block waits for the end
    p.lister.layer_done(1, 24)
    p.lister.layer_done(2, 24)
    assert p.last() == {11: Listed([5], full=1, layers=0), 12: Listed([8], full=1, layers=0)}


def test_a_step_that_completes_no_block_lists_nothing(monkeypatch) -> None:
    monkeypatch.setattr("meshserve.engine.kv_transfer.listing.LIST_EVERY_S", 0.0)
    p = _Prefill()
    p.lister.add("a", 11, 1)
    p.step(4, {"a": []}, last=("a",))
    p.forward(4)
    assert not p.published and not p.pins


def test_a_step_whose_forward_calls_no_hook_is_listed_as_the_next_is_launched() -> None:
    """(A step of one-token chunks runs through the fused decoder or a CUDA graph.)"""
    p = _Prefill()
    p.lister.add("a", 11, 1)
    p.step(1, {"a": [5, 6]}, last=("a",))
    assert not p.published  # its forward called nothing
    p.step(0, {})  # the next step: the one before has run
    assert p.last() == {11: Listed([5, 6], full=2, layers=0)}


def test_a_forward_that_is_not_the_steps_stops_listing_layer_by_layer(monkeypatch,
                                                                       capsys) -> None:
    monkeypatch.setattr("meshserve.engine.kv_transfer.listing.LIST_EVERY_S", 0.0)
    p = _Prefill()
    p.lister.add("a", 11, 1)
    p.step(16, {"a": [5, 6]}, last=("a",))
    p.lister.layer_done(0, 12)  # not the step launched: its blocks are not listed now
    assert not p.published
    assert "no longer listed layer by layer" in capsys.readouterr().err
    p.step(16, {"a": [5, 6, 7]}, last=("a",))  # but once the next step is launched
    assert p.published == [(1, {11: Listed([5, 6], full=2, layers=0)})]
    p.forward(16)  # and each step from then on, whatever its forward calls
    assert len(p.published) == 1
    p.step(0, {})
    assert p.last() == {11: Listed([5, 6, 7], full=3, layers=0)}
    assert p.pins == [5, 6, 7] and p.lister.streams["a"].open


@pytest.mark.parametrize("why", ["preempted", "closed"])
def test_a_preempted_or_closed_stream_pins_no_more(why: str) -> None:
    p = _Prefill()
    p.lister.add("a", 11, 1)
    p.step(16, {"a": [5, 6]})
    p.forward(16)
    if why == "closed":
        p.lister.close_stream("a")
    p.step(8, {"a": [5, 6, 2]}, preempted=why == "preempted")
    assert p.pins == [5, 6] and not p.lister.streams["a"].open
    assert p.last() == {11: Listed([5, 6], full=2, layers=0)}


def test_a_popped_stream_leaves_the_listing_and_its_steps_list_it_no_more() -> None:
    p = _Prefill()
    p.lister.add("a", 11, 1)
    p.lister.add("b", 12, 1)
    p.step(16, {"a": [5], "b": [8]})
    p.forward(16)
    p.step(16, {"a": [5, 6], "b": [8, 9]}, last=("a", "b"))
    p.lister.layer_done(0, 16)
    stream = p.lister.pop("a")  # its read is done (an abort) while its step runs
    assert stream is not None and stream.pinned == [5, 6]
    assert p.last() == {12: Listed([8, 9], full=1, layers=1)}
    for layer in (1, 2):
        p.lister.layer_done(layer, 16)
    assert p.last() == {12: Listed([8, 9], full=2, layers=0)}
