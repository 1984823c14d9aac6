"""Disaggregated serving on CPU: a prefill replica (this process) and a decode replica
(a child process), the prompt's KV moved between them by each connector. Greedy output
equals transformers'; a request aborted at any stage, or whose lease lapsed, leaves no
block held on either side; a lapsed lease fails the request (or is recomputed)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import torch
from helpers.disagg import (
    assert_each_block_moved_once,
    assert_no_blocks_held,
    kill_replica,
    run_until,
    shm_files,
)

from meshserve import LLM, SamplingParams
from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.disagg.front import DisaggEngine
from meshserve.engine.kv_transfer.nixl_agent import nixl_available
from meshserve.engine.kv_transfer.peers import grant_announced
from meshserve.engine.replicas.kv_handoff import FAULT_ENV

pytestmark = pytest.mark.slow

ONE_RANK = ["parallel=single", "threads=1", "engine.block_size=8", "disagg=manual",
            "disagg.min_prefill_tokens=16"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CONNECTORS = ["torch", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="needs nixl (pip install nixl)"))]


def disagg_llm(path: str, *extra: str) -> LLM:
    return LLM(path, overrides=ONE_RANK + list(extra), progress=False)


@pytest.mark.parametrize(("connector", "shm"), [
    ("torch", True), pytest.param("torch", False, id="torch-gloo"), *[
        pytest.param(*c.values, True, marks=c.marks, id=c.values[0]) for c in CONNECTORS[1:]]])
def test_one_prefill_one_decode_equals_transformers(make_checkpoint, prompts, expected,
                                                    connector: str, shm: bool) -> None:
    llm = disagg_llm(str(make_checkpoint("llama")), f"disagg.connector={connector}",
                     f"disagg.torch_shm={shm}")
    run = ""
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine) and engine.connector_name == connector
        assert engine.kv_run is not None
        run = engine.kv_run
        # while it serves, only the ranks' markers (the torch connector's shared memory)
        assert shm_files(run) == (["rank0", "rank1"] if connector == "torch" and shm
                                  else [])
        assert [s.role for s in engine.replica_states()] == ["prefill", "decode"]
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected
        for out in outs:
            assert out.finish_reason == "length" and out.metrics.num_generated_tokens == 12
            assert out.replica == 1  # the decode replica ends every request
        # layers x K/V x block x kv heads x head dim x fp32
        hopped = assert_each_block_moved_once(engine, prompts, 2 * 2 * 8 * 2 * 16 * 4)
        t = engine.transfers
        assert t.num_skipped == len(prompts) - len(hopped)  # short prompts prefill on decode
        assert_no_blocks_held(engine)
        # The same prompts again: the decode replica caches them, so nothing hops or moves.
        again = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in again] == expected
        assert engine.transfers.num_transfers == len(hopped)
        assert_no_blocks_held(engine)
    finally:
        llm.shutdown()
    assert shm_files(run) == []


@pytest.mark.parametrize("min_tokens", [16, 2])
def test_the_decode_replica_computes_only_the_first_token_of_a_hop(
        make_checkpoint, prompts, expected, tmp_path, min_tokens: int) -> None:
    """The prompt's partial last block comes with its full ones (or alone, for a prompt
    shorter than a block), so no step of the decode replica carries a prompt chunk of a
    request that hopped: only the prompts too short to hop."""
    overrides = [o for o in ONE_RANK if not o.startswith("disagg.min_prefill_tokens")]
    llm = LLM(str(make_checkpoint("llama")), progress=False, overrides=[
        *overrides, f"disagg.min_prefill_tokens={min_tokens}",
        f"engine.step_log={tmp_path / 's.jsonl'}"])
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    finally:
        llm.shutdown()
    lines = (tmp_path / "s.replica1.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "num_prefill_tokens" in r]
    assert steps and sum(r["num_prefill_tokens"] for r in steps) == sum(
        len(p) for p in prompts if 1 < len(p) < min_tokens)  # (one token is a decode row)


def test_disagg_auto_runs_the_planned_split(make_checkpoint, prompts, expected) -> None:
    llm = LLM(str(make_checkpoint("llama")), progress=False, overrides=[
        "threads=1", "engine.block_size=8", "disagg.min_prefill_tokens=16", "disagg=auto",
        "scenario=rag", "scenario.prompt_len=8000", "scenario.output_len=64",
        "scenario.ttft_slo_ms=4000", "scenario.tpot_slo_ms=1"])
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine)
        assert [s.role for s in engine.replica_states()] == ["prefill", "decode"]
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        assert engine.transfers.num_transfers > 0
        assert_no_blocks_held(engine)
    finally:
        llm.shutdown()


BF16_SIDES = [pytest.param("torch", (), id="torch"),
              pytest.param("nixl", (), id="nixl", marks=pytest.mark.skipif(
                  not nixl_available(), reason="needs nixl (pip install nixl)")),
              pytest.param("torch", ("disagg.decode.tp=2",), id="torch-decode-tp2")]


@pytest.mark.parametrize(("connector", "side"), BF16_SIDES)
def test_a_bf16_cache_hops_as_bf16(make_checkpoint, prompts, connector: str,
                                   side: tuple[str, ...]) -> None:
    """engine.kv_cache_dtype=bfloat16 on both sides: half the bytes on the wire, and the
    decode replica's log-probabilities those of a colocated run over the same cache."""
    path = str(make_checkpoint("llama"))
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    bf16 = "engine.kv_cache_dtype=bfloat16"
    colocated = LLM(path, overrides=["parallel=single", "threads=1", "engine.block_size=8", bf16],
                    progress=False)
    want = colocated.generate(prompts, sampling)
    llm = disagg_llm(path, f"disagg.connector={connector}", bf16, *side)
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine)
        outs = llm.generate(prompts, sampling)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        for got, ref in zip(outs, want):
            assert got.logprobs is not None and ref.logprobs is not None
            torch.testing.assert_close([lp for lp, _ in got.logprobs],
                                       [lp for lp, _ in ref.logprobs], atol=1e-5, rtol=0)
        # layers x K/V x block x kv heads x head dim x bf16
        assert_each_block_moved_once(engine, prompts, 2 * 2 * 8 * 2 * 16 * 2)
        assert_no_blocks_held(engine)
    finally:
        llm.shutdown()


NIXL_ONLY = pytest.mark.skipif(not nixl_available(), reason="needs nixl (pip install nixl)")


def assert_no_grant_left(engine: DisaggEngine) -> None:
    """Every grant announced in the KV store is gone from it."""
    assert not engine._grant_keys
    assert engine._store is not None
    last = next(engine._transfer_ids)
    assert not any(grant_announced(engine._store, i) for i in range(1, last))


SIDES = [pytest.param(("disagg.prefill.tp=2",), id="prefill-tp2"),
         pytest.param(("disagg.decode.tp=2",), id="decode-tp2"),
         pytest.param(("disagg.prefill.pp=2",), id="prefill-pp2"),
         pytest.param(("disagg.decode.pp=2",), id="decode-pp2"),
         pytest.param(("disagg.prefill.replicas=2",), id="two-prefill")]


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("side", SIDES)
def test_sides_of_other_tp_and_pp_equal_transformers(make_checkpoint, prompts, expected,
                                                     connector: str,
                                                     side: tuple[str, ...]) -> None:
    """KV heads resharded (tp 2 -> 1, 1 -> 2) and stages gathered or split (pp 2 <-> 1)
    on the way: every rank moves its own piece; the same tokens, the same bytes. With two
    prefill replicas, replica 1's KV moves from another process than the front's."""
    llm = disagg_llm(str(make_checkpoint("llama")), f"disagg.connector={connector}", *side)
    try:
        engine = llm.engine
        assert isinstance(engine, DisaggEngine)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected
        # every layer and head once, whatever the split
        hopped = assert_each_block_moved_once(engine, prompts, 2 * 2 * 8 * 2 * 16 * 4)
        t = engine.transfers
        assert t.num_transfers == len(hopped) and t.num_failed == 0
        if engine.num_prefill == 2:
            assert engine.requests_per_replica[1] > 0  # some prompts prefilled there
            assert_no_grant_left(engine)
        assert_no_blocks_held(engine)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.usefixtures("slow_transfers")
def test_an_abort_of_an_announced_read_frees_both_sides(make_checkpoint, prompts,
                                                        expected, connector: str) -> None:
    """2P+1D, pulls starting 0.6 s late: requests prefilled on replica 1 are aborted once
    their read is announced; the others keep transformers' tokens, and no block or key is
    left."""
    llm = LLM(str(make_checkpoint("llama")), progress=False, min_replicas=2, overrides=[
        *ONE_RANK, "disagg.prefill.replicas=2", f"disagg.connector={connector}"])
    try:
        engine = llm.engine
        long = [i for i, p in enumerate(prompts) if len(p) >= 16]
        ids = {engine.add_request(prompts[i], GREEDY): i for i in long}

        def announced_on_1(_: list[RequestOutput]) -> bool:
            return any(h.prefill == 1 and h.stage == "import" for h in engine._hops.values())

        outs = run_until(engine, announced_on_1)
        aborted = {r for r, h in engine._hops.items()
                   if h.prefill == 1 and h.stage == "import"}
        for rid in aborted:
            engine.abort(rid)
        outs += run_until(engine, lambda o: not engine.has_unfinished(), 60.0)
        finished = {o.request_id: o for o in outs if o.finished}
        assert set(finished) == set(ids) - aborted
        for rid, out in finished.items():
            assert out.token_ids == expected[ids[rid]], rid
        deadline = time.monotonic() + 10
        while engine._transfers or engine._grant_keys:
            assert time.monotonic() < deadline, (engine._transfers, engine._grant_keys)
            engine.step()
        assert_no_grant_left(engine)
        assert_no_blocks_held(engine)
    finally:
        llm.shutdown()


def kill_and_finish(engine: DisaggEngine, index: int, outs: list[RequestOutput]
                    ) -> dict[str, RequestOutput]:
    """SIGKILL replica `index`, run every request to its end (within 30 s of the kill);
    the finished outputs so far and since, by request id."""
    kill_replica(engine, index)
    t0 = time.monotonic()
    outs = outs + run_until(engine, lambda o: not engine.has_unfinished(), 60.0)
    assert time.monotonic() - t0 < 30
    return {o.request_id: o for o in outs if o.finished}


@pytest.fixture()
def slow_transfers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(FAULT_ENV, "pull=0.6")
    yield


@pytest.mark.usefixtures("slow_transfers")
@pytest.mark.parametrize("connector", CONNECTORS)
def test_an_abort_at_any_stage_frees_both_sides(make_checkpoint, prompts,
                                                connector: str) -> None:
    llm = disagg_llm(str(make_checkpoint("llama")), f"disagg.connector={connector}")
    try:
        engine = llm.engine
        long = [p for p in prompts if len(p) >= 16]
        queued = engine.add_request(long[0], GREEDY)  # aborted before it ran
        engine.abort(queued)
        moving = engine.add_request(long[1], GREEDY)  # aborted once its first token is out
        # aborted while it decodes: the decode replica runs ahead of the front, so it is
        # given room never to finish before the abort reaches it
        decoding = engine.add_request(long[2], SamplingParams(
            max_tokens=200, temperature=0.0, ignore_eos=True))
        kept = engine.add_request(long[3], GREEDY)
        outs = run_until(engine, lambda o: any(x.request_id == moving for x in o))
        engine.abort(moving)  # its KV is held or in flight now (transfers start 0.6 s late)
        outs = run_until(engine, lambda o: any(x.request_id == decoding and
                                               len(x.token_ids) >= 3 for x in o))
        engine.abort(decoding)
        outs += run_until(engine, lambda o: not engine.has_unfinished(), 60.0)
        finished = {o.request_id for o in outs if o.finished}
        assert finished == {kept}
        deadline = time.monotonic() + 10
        while engine._transfers:  # late replies of the aborted ones
            assert time.monotonic() < deadline
            engine.step()
        assert_no_blocks_held(engine)
        assert not engine.has_unfinished()
    finally:
        llm.shutdown()


def run_longest(engine: DisaggEngine, prompts: list[list[int]]) -> tuple[int, RequestOutput]:
    """Run the longest prompt alone to its end: its index and its last output."""
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    rid = engine.add_request(prompts[i], GREEDY)
    outs = run_until(engine, lambda o: any(x.finished for x in o))
    (last,) = [o for o in outs if o.finished]
    assert last.request_id == rid
    return i, last


@pytest.mark.parametrize("on_failure", ["fail", "recompute"])
def test_a_lapsed_lease_fails_the_request_or_recomputes(make_checkpoint, prompts, expected,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        on_failure: str) -> None:
    monkeypatch.setenv(FAULT_ENV, "held=1.0")  # the front begins the read after it lapsed
    llm = disagg_llm(str(make_checkpoint("llama")), "disagg.connector=torch",
                     "disagg.stream_kv=false", "disagg.kv_lease_s=0.2",
                     f"disagg.on_failure={on_failure}")
    try:
        engine = llm.engine
        i, last = run_longest(engine, prompts)
        assert engine.transfers.num_expired == 1
        assert engine.transfers.num_failed == 1 and engine.transfers.num_transfers == 0
        if on_failure == "fail":
            assert last.finish_reason == "error" and "disagg.kv_lease_s=0.2" in last.error
            assert last.token_ids == expected[i][:1]  # the first token was served; no more
        else:
            assert last.finish_reason == "length" and last.token_ids == expected[i]
        assert_no_blocks_held(engine)
    finally:
        llm.shutdown()


def test_a_killed_decode_replica_fails_its_requests_and_the_other_serves_on(
        make_checkpoint, prompts, expected) -> None:
    path = str(make_checkpoint("llama"))
    llm = LLM(path, overrides=[*ONE_RANK, "disagg.decode.replicas=2", "disagg.connector=torch",
                               "parallel.timeout_s=5", "disagg.transfer_timeout_s=5"],
              progress=False, min_replicas=2)
    run = ""
    try:
        engine = llm.engine
        run = engine.kv_run or ""
        assert [s.role for s in engine.replica_states()] == ["prefill", "decode", "decode"]
        long = [i for i, p in enumerate(prompts) if len(p) >= 16]
        # long enough that the replica, running ahead of the front, is still decoding them
        # when it is killed; greedy, so their first 12 tokens are transformers'
        params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        ids = {engine.add_request(prompts[i], params): i for i in long}

        def decoding_on_2(_: list[RequestOutput]) -> bool:
            return any(engine._owner.get(r) == 2 and engine._hops[r].stage == "decode"
                       for r in ids)

        outs = run_until(engine, decoding_on_2)  # then kill replica 2
        on_victim = {r for r in ids if engine._owner.get(r) == 2}
        assert on_victim
        finished = kill_and_finish(engine, 2, outs)
        assert set(finished) == set(ids)
        for rid, i in ids.items():
            out = finished[rid]
            if rid in on_victim:
                assert out.finish_reason == "error" and "replica 2" in out.error, out.error
            else:
                assert out.token_ids[:12] == expected[i] and len(out.token_ids) == 120
        assert engine.down.keys() == {2}
        again = llm.generate([prompts[long[0]]], GREEDY)  # goes to the survivor
        assert again[0].token_ids == expected[long[0]] and again[0].replica == 1
        # a send to the killed replica already begun fails within transfer_timeout_s
        assert_no_blocks_held(engine, within_s=15.0)
    finally:
        llm.shutdown()
    assert run and shm_files(run) == []  # the killed rank's marker went at the end too


def test_a_killed_prefill_replica_fails_or_recomputes_what_it_held(
        make_checkpoint, prompts, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    """2P+1D with every pull starting 1 s late, replica 1 (a prefill replica) killed once
    it holds KV the decode replica was told to import: the requests it was still
    prefilling end in an error naming it; those whose first token was out are prefilled
    again on the decode replica (on_failure=recompute) and keep transformers' tokens."""
    monkeypatch.setenv(FAULT_ENV, "pull=1.0")
    path = str(make_checkpoint("llama"))
    llm = LLM(path, overrides=[*ONE_RANK, "disagg.prefill.replicas=2", "disagg.connector=torch",
                               "disagg.on_failure=recompute", "parallel.timeout_s=5",
                               "disagg.transfer_timeout_s=5"],
              progress=False, min_replicas=2)
    run = ""
    try:
        engine = llm.engine
        run = engine.kv_run or ""
        assert [s.role for s in engine.replica_states()] == ["prefill", "prefill", "decode"]
        long = [i for i, p in enumerate(prompts) if len(p) >= 16]
        ids = {engine.add_request(prompts[i], GREEDY): i for i in long}

        def held_on_1(_: list[RequestOutput]) -> bool:
            return any(h.prefill == 1 and h.stage == "import" for h in engine._hops.values())

        outs = run_until(engine, held_on_1)
        held = {r for r, h in engine._hops.items() if h.prefill == 1 and h.stage == "import"}
        finished = kill_and_finish(engine, 1, outs)
        assert set(finished) == set(ids)
        for rid, i in ids.items():
            out = finished[rid]
            if out.finish_reason == "error":
                assert rid not in held and "replica 1" in out.error, out.error
            else:
                assert out.token_ids == expected[i], rid
        assert held and all(finished[r].finish_reason == "length" for r in held)
        assert engine.down.keys() == {1}
        assert_no_blocks_held(engine)
    finally:
        llm.shutdown()
    assert run and shm_files(run) == []  # the killed rank's marker went at the end too


@pytest.mark.parametrize(("connector", "shm"), [
    ("torch", True), pytest.param("torch", False, id="torch-gloo"), *[
        pytest.param(*c.values, True, marks=c.marks, id=c.values[0]) for c in CONNECTORS[1:]]])
def test_a_prefill_replica_killed_during_a_granted_read_recomputes_it(
        make_checkpoint, prompts, expected, monkeypatch: pytest.MonkeyPatch,
        connector: str, shm: bool) -> None:
    """2P+1D with every pull starting 1.5 s late: replica 1 is killed once it granted a
    read, before the decode replica reads. The read fails within
    disagg.transfer_timeout_s and the request is prefilled again on the decode replica,
    keeping transformers' tokens."""
    monkeypatch.setenv(FAULT_ENV, "pull=1.5")
    path = str(make_checkpoint("llama"))
    llm = LLM(path, overrides=[*ONE_RANK, "disagg.prefill.replicas=2",
                               f"disagg.connector={connector}", "disagg.on_failure=recompute",
                               f"disagg.torch_shm={shm}",
                               "disagg.transfer_timeout_s=5", "parallel.timeout_s=5"],
              progress=False, min_replicas=2)
    run = ""
    try:
        engine = llm.engine
        run = engine.kv_run or ""
        long = [i for i, p in enumerate(prompts) if len(p) >= 16]
        ids = {engine.add_request(prompts[i], GREEDY): i for i in long}

        def granted_on_1(_: list[RequestOutput]) -> bool:
            return any(h.prefill == 1 and h.granted and h.stage == "import"
                       for h in engine._hops.values())

        outs = run_until(engine, granted_on_1)
        reading = {r for r, h in engine._hops.items() if h.prefill == 1 and h.granted}
        finished = kill_and_finish(engine, 1, outs)
        assert set(finished) == set(ids)
        for rid in reading:
            assert finished[rid].finish_reason == "length"
            assert finished[rid].token_ids == expected[ids[rid]], rid
        assert engine.transfers.num_failed >= len(reading)
        assert_no_blocks_held(engine)
    finally:
        llm.shutdown()
    assert run and shm_files(run) == []


def test_the_front_hashes_each_prompt_once(make_checkpoint, prompts, monkeypatch) -> None:
    """The router's block chain of a prompt is computed at admission and read by the
    prefill router, the decode replicas' trees and the move to a decode replica."""
    from meshserve.engine.disagg import front
    from meshserve.engine.replicas.router import PromptTree

    calls: list[int] = []
    real = front.prompt_chain
    monkeypatch.setattr(front, "prompt_chain",
                        lambda ids, bs: calls.append(len(ids)) or real(ids, bs))
    monkeypatch.setattr(PromptTree, "chain", lambda *a: pytest.fail("hashed again"))
    llm = disagg_llm(str(make_checkpoint("llama")))
    try:
        llm.generate(prompts, GREEDY)
        assert len(calls) == len(prompts)
    finally:
        llm.shutdown()


def test_a_read_still_writing_keeps_its_blocks_out_of_use(make_checkpoint, prompts, expected,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A transfer that neither ends nor cancels (fault-injected): the import fails, the
    request is recomputed on the decode replica, and the blocks the READ might still
    write stay out of use there, while everything else goes back."""
    monkeypatch.setenv(FAULT_ENV, "stuck=0.1")
    llm = disagg_llm(str(make_checkpoint("llama")), "disagg.connector=torch",
                     "disagg.stream_kv=false", "disagg.on_failure=recompute")
    try:
        engine = llm.engine
        i, last = run_longest(engine, prompts)
        assert last.token_ids == expected[i]
        assert engine.transfers.num_failed == 1 and engine.transfers.num_transfers == 0
        engine.reset_prefix_cache()
        used = {s.index: s.stats.num_used_blocks for s in engine.replica_states()}
        kept = (len(prompts[i]) - 1) // 8 + 1  # its fresh full blocks and its tail
        assert used == {0: 0, 1: kept}
    finally:
        llm.shutdown()
