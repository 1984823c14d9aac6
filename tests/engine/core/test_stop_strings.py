"""Stop strings: the text is cut at the first stop, and what is released along the way never
shows the start of a stop, however the text is split into deltas."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from meshserve import LLM, SamplingParams
from meshserve.engine.core.stop_strings import StopStrings


def stream(stops: list[str], deltas: list[str]) -> tuple[list[str], StopStrings]:
    s = StopStrings(stops)
    out = [s.add(d, final=i == len(deltas) - 1) for i, d in enumerate(deltas)]
    return out, s


def test_a_tail_that_may_begin_a_stop_is_held_until_it_does_not() -> None:
    out, s = stream(["END"], ["abc E", "N", "x", "yz"])
    assert out == ["abc ", "", "ENx", "yz"]
    assert s.text == "abc ENxyz" and not s.stopped


def test_the_text_is_cut_before_the_first_stop() -> None:
    out, s = stream(["END", "xy"], ["ab E", "ND more", "xy"])
    assert out == ["ab ", "", ""]
    assert s.text == "ab " and s.stopped


def test_the_held_tail_is_released_at_the_end() -> None:
    out, _ = stream(["ENDING"], ["abc", " END"])
    assert out == ["abc", " END"]


@given(st.text(alphabet="ab ", max_size=40), st.lists(st.text(alphabet="ab", min_size=1,
                                                               max_size=4), max_size=3),
       st.randoms())
def test_streamed_equals_whole_for_any_split(text: str, stops: list[str],
                                             rng: random.Random) -> None:
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out, s = stream(stops, deltas)
    ends = [(i + len(x), i) for x in stops if (i := text.find(x)) != -1]
    want = text[:min(ends)[1]] if ends else text  # the stop that ends first
    assert "".join(out) == s.text == want
    for k in range(1, len(out)):  # nothing released yet starts a stop the text completes
        shown = "".join(out[:k])
        assert all(x not in shown for x in stops)


def test_engine_streams_exactly_the_non_streamed_text_for_multi_token_stops() -> None:
    llm = LLM("meshcoder", parallel="single", progress=False)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = "def fibonacci(n):"
    full = llm.generate([prompt], params)[0].text
    rng = random.Random(0)
    checked = 0
    for _ in range(25):
        a = rng.randrange(1, len(full) - 6)
        stop = full[a:a + rng.randint(3, 6)]
        want = full[:full.index(stop)]
        engine = llm.engine
        rid = engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0,
                                                        ignore_eos=True, stop=[stop]))
        deltas, final = [], None
        while engine.has_unfinished():
            for o in engine.step():
                assert o.request_id == rid
                deltas.append(o.new_text)
                final = o
        assert final is not None and final.finished and final.finish_reason == "stop"
        assert "".join(deltas) == final.text == want
        assert all(stop not in "".join(deltas[:k]) for k in range(len(deltas)))
        checked += 1
    assert checked == 25
    llm.shutdown()
