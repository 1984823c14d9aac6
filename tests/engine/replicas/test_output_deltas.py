"""A replica sends each output's delta; the front rebuilds every output whole, equal to the
one the replica's engine returned: streaming several tokens a step (speculation), stop
strings held back, logprobs, aborts and a request id used again."""

from __future__ import annotations

import pickle

from helpers.speculation import ONE_RANK, PROMPTS

from meshserve import LLM, SamplingParams
from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.replicas.output_deltas import OutputPacker, OutputUnpacker

FIELDS = ("request_id", "prompt_token_ids", "token_ids", "text", "new_token_ids", "new_text",
          "finished", "finish_reason", "logprobs", "replica", "error")


def check_round_trip(llm: LLM, params: list[SamplingParams], abort_after: int | None = None,
                     packer: OutputPacker | None = None, unpacker: OutputUnpacker | None = None,
                     request_ids: list[str] | None = None) -> int:
    """Every step's outputs through a packer, pickling and an unpacker equal the engine's;
    returns how many outputs went through."""
    engine = llm.engine
    packer, unpacker = packer or OutputPacker(), unpacker or OutputUnpacker()
    ids = [engine.add_request(p, sp, request_id=rid)
           for p, sp, rid in zip(PROMPTS, params, request_ids or [None] * len(params))]
    n = steps = 0
    while engine.has_unfinished():
        outs: list[RequestOutput] = engine.step()
        got = unpacker.unpack(pickle.loads(pickle.dumps(packer.pack(outs))))
        for want, have in zip(outs, got, strict=True):
            assert [getattr(have, f) for f in FIELDS] == [getattr(want, f) for f in FIELDS]
            assert have.metrics == want.metrics
        n += len(outs)
        steps += 1
        if steps == abort_after:
            assert engine.abort(ids[0])
            packer.forget(ids[0])
            unpacker.forget(ids[0])
    assert not unpacker._so_far and not packer._started  # nothing kept for ended requests
    return n


def test_outputs_survive_the_wire_with_drafts_stops_and_logprobs() -> None:
    llm = LLM("meshcoder", overrides=[*ONE_RANK, "speculative=ngram",
                                      "speculative.max_batch_size=64"], progress=False)
    try:
        params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                 stop=["import sys"]),
                  SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
                  SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True),
                  SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)]
        packer, unpacker = OutputPacker(), OutputUnpacker()
        ids = ["a", "b", "c", "d", "e"]
        assert check_round_trip(llm, params, None, packer, unpacker, ids) > len(params)
        assert llm.engine.stats.spec.num_accepted_tokens > 0  # several tokens in a step
        # The same ids again on the same wire (a request moved back to a replica), one
        # of them aborted mid-way.
        again = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 2
        check_round_trip(llm, again, 3, packer, unpacker, ids[:2])
    finally:
        llm.shutdown()


def test_a_first_output_starts_a_request_over() -> None:
    """An id the unpacker still holds (its replica never finished it) starts over when a
    first output, the prompt with it, arrives for it again."""
    packer, unpacker = OutputPacker(), OutputUnpacker()
    first = RequestOutput("r", [1, 2], [7], "a", [7], "a")
    unpacker.unpack(packer.pack([first]))
    packer.forget("r")
    again = RequestOutput("r", [1, 2], [9], "b", [9], "b")
    (out,) = unpacker.unpack(packer.pack([again]))
    assert (out.token_ids, out.text, out.prompt_token_ids) == ([9], "b", [1, 2])
