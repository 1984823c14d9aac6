"""Prompts whose KV is read as it is computed (disagg.stream_kv, over NIXL and the torch
connector, on CPU).

Prompts are prefilled 8 tokens a step and the prefill replica waits a little after it
lists new blocks, so the decode replica reads most of each prompt before its first token
is out; a prompt prefilled in one step is read a layer at a time as its step runs.
Greedy tokens stay transformers'; every block moves once; an abort, an early
stop, a refusal and a killed replica on either side leave no block held and no key in
the KV store."""

from __future__ import annotations

import random
import time

import pytest
import torch
from helpers.disagg import (
    assert_each_block_moved_once,
    assert_no_blocks_held,
    kill_replica,
    run_until,
)

from meshserve import LLM, SamplingParams
from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.disagg.front import DisaggEngine
from meshserve.engine.kv_transfer.nixl_agent import nixl_available
from meshserve.engine.kv_transfer.peers import KVPeers, grant_announced, listed_blocks
from meshserve.engine.replicas.kv_handoff import FAULT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(),
                                                   reason="needs nixl (pip install nixl)")]

STREAMED = ["parallel=single", "threads=1", "engine.block_size=8", "disagg=manual",
            "disagg.min_prefill_tokens=16", "disagg.connector=nixl",
            "engine.max_num_batched_tokens=8"]
KILLABLE = ["parallel.timeout_s=5", "disagg.transfer_timeout_s=5"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 8 * 2 * 16 * 4  # layers x K/V x block x kv heads x head dim x fp32


@pytest.fixture()
def slow_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "list=0.05")


def streamed_llm(path: str, *extra: str, min_replicas: int | None = None) -> LLM:
    return LLM(path, overrides=STREAMED + list(extra), progress=False,
               min_replicas=min_replicas)


def assert_all_freed(engine: DisaggEngine, within_s: float = 15.0) -> None:
    """Nothing read, pinned or listed anywhere: the front's reads ended, every key gone
    from the KV store, every live replica's blocks back to baseline."""
    deadline = time.monotonic() + within_s
    while engine._transfers or engine._grant_keys:
        assert time.monotonic() < deadline, (engine._transfers, engine._grant_keys)
        engine.step()
    assert engine._store is not None
    last = next(engine._transfer_ids)
    assert not any(grant_announced(engine._store, i) for i in range(1, last))
    # A prefill replica unlists a prompt once its ReadDone arrives, after the front's end.
    # (A lost one's listing stays: nobody reads it.)
    store = engine._store
    listed = {(src, dst): listed_blocks(store, src, dst) for src in range(engine.num_prefill)
              if src not in engine.down for dst in range(engine.num_prefill, engine.dp)}
    while any(listed.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        listed = {k: listed_blocks(store, *k) for k in listed}
    assert not any(listed.values()), listed
    assert_no_blocks_held(engine, within_s=max(0.0, deadline - time.monotonic()) + 1.0)


@pytest.mark.usefixtures("slow_prefill")
@pytest.mark.parametrize("side", [(), ("disagg.prefill.tp=2",), ("disagg.decode.tp=2",),
                                  ("engine.async_scheduling=true",),
                                  ("disagg.stream_kv=false",), ("disagg.connector=torch",),
                                  ("disagg.connector=torch", "disagg.prefill.tp=2"),
                                  ("disagg.connector=torch", "disagg.prefill.tp=2",
                                   "disagg.torch_shm=false", "disagg.torch_wire=gloo_pairs")],
                         ids=["1P+1D", "prefill-tp2", "decode-tp2", "async", "off", "torch",
                              "torch-prefill-tp2", "torch-pairs-prefill-tp2"])
def test_streamed_prompts_equal_transformers_and_move_each_block_once(
        make_checkpoint, prompts, expected, side: tuple[str, ...], slow_prefill) -> None:
    """(The prefill replica pauses after each step that lists blocks, so the reads overlap
    its prefill even when other processes share the cores.)"""
    llm = streamed_llm(str(make_checkpoint("llama")), *side)
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected
        hopped = assert_each_block_moved_once(engine, prompts, BLOCK_BYTES)
        t = engine.transfers
        if "disagg.stream_kv=false" in side:
            assert t.bytes_streamed == 0
        else:  # most full blocks were read before their prompt's first token
            assert t.bytes_streamed >= sum(len(p) // 8 for p in hopped) * BLOCK_BYTES // 2
        assert_all_freed(engine)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("side", [("disagg.connector=nixl",), ("disagg.connector=torch",),
                                  ("disagg.connector=torch", "disagg.prefill.tp=2"),
                                  ("disagg.connector=nixl", "engine.async_scheduling=true"),
                                  ("disagg.connector=torch", "disagg.torch_shm=false",
                                   "disagg.torch_wire=gloo")],
                         ids=["nixl", "torch", "torch-prefill-tp2", "nixl-async",
                              "torch-tagged-gloo"])
def test_prompts_of_one_step_are_read_layer_by_layer(make_checkpoint, prompts, expected,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     side: tuple[str, ...]) -> None:
    """Prompts prefilled in one step each, whose layers are slow: the decode replica reads
    each prompt's first layer while its second is computed, and only the second and the
    tail after the first token."""
    monkeypatch.setenv(FAULT_ENV, "layer=0.1")
    one_step = [o for o in STREAMED if not o.startswith(("engine.max_num_batched_tokens",
                                                         "disagg.connector"))]
    llm = LLM(str(make_checkpoint("llama")), progress=False,
              overrides=one_step + ["engine.max_num_batched_tokens=64", *side])
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine)
        outs = [llm.generate([p], GREEDY)[0] for p in prompts]  # one step each
        assert [o.token_ids for o in outs] == expected
        hopped = assert_each_block_moved_once(engine, prompts, BLOCK_BYTES)
        first_layers = sum(len(p) // 8 for p in hopped) * BLOCK_BYTES // 2
        t = engine.transfers
        assert first_layers // 2 <= t.bytes_layered <= first_layers, (t, first_layers)
        assert t.bytes_layered <= t.bytes_streamed
        assert_all_freed(engine)
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("slow_prefill")
def test_an_abort_or_a_stop_while_streaming_frees_both_sides(make_checkpoint, prompts,
                                                             expected) -> None:
    """One request aborted while its prompt is half read, one stopped by its first token
    (nothing more to read), one whose prompt the decode replica already caches (no hop, so
    no stream), one kept."""
    llm = streamed_llm(str(make_checkpoint("llama")))
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine)
        i64, i57, i40, i31 = (next(i for i, p in enumerate(prompts) if len(p) == n)
                              for n in (64, 57, 40, 31))
        llm.generate([prompts[i40]], GREEDY)  # now the decode replica caches it
        aborted = engine.add_request(prompts[i64], GREEDY)
        stopped = engine.add_request(prompts[i57], SamplingParams(
            max_tokens=12, temperature=0.0, stop_token_ids=[expected[i57][0]]))
        kept = engine.add_request(prompts[i31], GREEDY)
        cached = engine.add_request(prompts[i40], GREEDY)
        assert engine._hops[aborted].streamed and engine._hops[stopped].streamed
        assert cached not in engine._hops  # mostly cached there: no hop at all
        assert engine._store is not None
        peers = KVPeers(engine._store, engine.disagg.ranks_per_replica)
        tid = engine._hops[aborted].transfer_id
        deadline = time.monotonic() + 30  # (the replicas step on their own)
        while (listed := peers.listed(0, 1).get(tid)) is None or listed.full < 2:  # 2 of 8
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert engine._hops[aborted].stage == "prefill"  # still being computed
        engine.abort(aborted)
        outs = run_until(engine, lambda _: not engine.has_unfinished())
        finished = {o.request_id: o for o in outs if o.finished}
        assert set(finished) == {stopped, kept, cached}
        assert finished[stopped].token_ids == expected[i57][:1]
        assert finished[kept].token_ids == expected[i31]
        assert finished[cached].token_ids == expected[i40]
        assert engine.transfers.num_failed == 0
        assert_all_freed(engine)
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("slow_prefill")
def test_a_decode_replica_killed_while_it_streams_leaves_the_prompt_to_the_other(
        make_checkpoint, prompts, expected) -> None:
    """1P+2D: the decode replica reading a prompt as it is computed is killed; the prompt
    goes to the other decode replica once its first token is out, with transformers'
    tokens, and the prefill replica's pins go."""
    llm = streamed_llm(str(make_checkpoint("llama")), "disagg.decode.replicas=2", *KILLABLE,
                       min_replicas=2)
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine)
        i64 = next(i for i, p in enumerate(prompts) if len(p) == 64)
        rid = engine.add_request(prompts[i64], GREEDY)
        hop = engine._hops[rid]
        assert hop.streamed and hop.decode in (1, 2)
        victim = hop.decode
        time.sleep(0.2)
        kill_replica(engine, victim)
        outs = run_until(engine, lambda _: not engine.has_unfinished())
        (out,) = [o for o in outs if o.finished]
        assert out.finish_reason == "length" and out.token_ids == expected[i64]
        assert out.replica == 3 - victim and engine.down.keys() == {victim}
        assert_all_freed(engine)
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("slow_prefill")
def test_a_prefill_replica_killed_while_it_streams_fails_its_prompt_and_frees_the_decode(
        make_checkpoint, prompts, expected) -> None:
    """2P+1D: prefill replica 1 is killed while its prompt is read as it is computed; the
    request ends in an error naming it, the decode replica frees what it took, and a
    prompt on replica 0 keeps transformers' tokens."""
    llm = streamed_llm(str(make_checkpoint("llama")), "disagg.prefill.replicas=2", *KILLABLE,
                       min_replicas=2)
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine)
        long = sorted((i for i, p in enumerate(prompts) if len(p) >= 40),
                      key=lambda i: -len(prompts[i]))
        ids = {engine.add_request(prompts[i], GREEDY): i for i in long}
        on_1 = {r for r in ids if engine._hops[r].prefill == 1}
        assert on_1 and len(on_1) < len(ids)
        time.sleep(0.2)
        kill_replica(engine, 1)
        outs = run_until(engine, lambda _: not engine.has_unfinished())
        finished = {o.request_id: o for o in outs if o.finished}
        assert set(finished) == set(ids)
        for rid, i in ids.items():
            out = finished[rid]
            if rid in on_1 and out.finish_reason == "error":
                assert "replica 1" in out.error, out.error
            else:
                assert out.token_ids == expected[i], rid
        assert any(finished[r].finish_reason == "error" for r in on_1)
        assert_all_freed(engine)
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("slow_prefill")
def test_a_decode_replica_short_of_room_refuses_the_stream(make_checkpoint, prompts,
                                                           expected) -> None:
    """20 blocks a replica: while one request decodes on the decode replica and holds
    most of them, a second prompt's stream is refused there (its running sequence needs
    the room); the prompt is then imported as any other, and both keep transformers'
    tokens."""
    llm = streamed_llm(str(make_checkpoint("llama")), "engine.num_gpu_blocks=20")
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine)
        i64, i57 = (next(i for i, p in enumerate(prompts) if len(p) == n) for n in (64, 57))
        first = engine.add_request(prompts[i64], SamplingParams(
            max_tokens=85, temperature=0.0, ignore_eos=True))  # 19 blocks at its end
        outs = run_until(engine, lambda o: any(x.request_id == first and
                                               len(x.token_ids) >= 45 for x in o))
        second = engine.add_request(prompts[i57], GREEDY)  # its 7 blocks are not free
        hop = engine._hops[second]
        assert hop.streamed
        outs += run_until(engine, lambda _: not hop.streamed or hop.stage != "prefill")
        assert not hop.streamed and hop.stage == "prefill" and hop.decode is None
        outs += run_until(engine, lambda _: not engine.has_unfinished())
        finished = {o.request_id: o for o in outs if o.finished}
        assert finished[first].token_ids[:12] == expected[i64]
        assert len(finished[first].token_ids) == 85
        assert finished[second].token_ids == expected[i57]
        assert_all_freed(engine)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("seed", "connector"), [(1, "nixl"), (2, "torch")])
def test_many_streamed_prompts_with_random_aborts_keep_their_tokens(make_checkpoint,
                                                                    seed: int,
                                                                    connector: str) -> None:
    """1P+2D, 40 prompts of 10-120 tokens, steps of 8-24 tokens, 64 blocks a replica, about
    a fifth aborted at random points: every other request has a colocated run's greedy
    tokens, and nothing is left read, pinned or listed."""
    path = str(make_checkpoint("llama"))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 320, (rng.randint(10, 120),), generator=gen).tolist()
               for _ in range(40)]
    params = [SamplingParams(max_tokens=rng.randint(2, 20), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    ref = LLM(path, overrides=["parallel=single", "threads=1", "engine.block_size=8"],
              progress=False)
    try:
        want = [o.token_ids for o in ref.generate(prompts, params)]
    finally:
        ref.shutdown()
    llm = streamed_llm(path, "disagg.decode.replicas=2", "engine.num_gpu_blocks=64",
                       f"engine.max_num_batched_tokens={rng.choice([8, 16, 24])}",
                       f"disagg.connector={connector}")
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine)
        ids: dict[str, int] = {}
        aborted: set[str] = set()
        outs: list[RequestOutput] = []
        for i, p in enumerate(prompts):
            ids[engine.add_request(p, params[i])] = i
            for _ in range(rng.randint(0, 3)):
                outs += engine.step()
            live = [r for r in ids if r not in aborted and r in engine._owner]
            if live and rng.random() < 0.2:
                victim = rng.choice(live)
                engine.abort(victim)
                aborted.add(victim)
        outs += run_until(engine, lambda _: not engine.has_unfinished(), 120.0)
        finished = {o.request_id: o for o in outs if o.finished}
        for rid, i in ids.items():
            if rid not in aborted:
                assert finished[rid].token_ids == want[i], rid
        assert aborted and engine.transfers.bytes_streamed > 0
        assert_all_freed(engine)
    finally:
        llm.shutdown()
