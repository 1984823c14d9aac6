"""A lost data-parallel replica (killed or hung) with min_replicas below dp: its requests
end with an error naming it in bounded time, the survivor finishes its own with the
tokens of one engine and frees every KV block, and new requests go to the survivor."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.engine.build import make_engine
from meshserve.engine.config.run import resolve_run
from meshserve.engine.core.outputs import RequestOutput
from meshserve.launch.cli_config import load_config
from meshserve.parallel.comm.ranks import RankFailure

pytestmark = pytest.mark.slow

ENGINE = ["parallel=single", "engine.block_size=4", "engine.num_gpu_blocks=64",
          "engine.max_num_batched_tokens=32", "threads=1"]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
"""Long enough that the replica lost once it has produced something still has work then,
however far it ran ahead of a busy front (24 tokens were not, on a loaded machine)."""


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (7, 12, 19, 26, 9, 15)]


@pytest.fixture(scope="module")
def single(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(str(checkpoint), overrides=ENGINE, progress=False) as llm:
        return [o.token_ids for o in llm.generate(prompts, PARAMS)]


def _run_until_done(engine, ids: list[str]) -> dict[str, RequestOutput]:  # noqa: ANN001
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == set(ids)
    return done


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_replica_fails_its_requests_and_the_survivor_serves_on(
        checkpoint: Path, prompts: list[list[int]], single: list[list[int]], how: str) -> None:
    overrides = [*ENGINE, "parallel.dp=2", "parallel.timeout_s=3", f"model.path={checkpoint}",
                 "engine.num_gpu_blocks=512"]  # (room for the long requests)
    run = resolve_run(load_config(overrides).runtime, env=None, announce=False)
    engine = make_engine(run, progress=False, min_replicas=1)
    try:
        ids = [engine.add_request(p, LONG) for p in prompts]
        owner = {rid: engine._owner[rid] for rid in ids}
        assert set(owner.values()) == {0, 1}
        # Once the second replica has produced something, its process dies (or stops
        # answering); it runs ahead of the front, so a request of its may be done by then.
        done: dict[str, RequestOutput] = {}
        heard_from_1 = False
        while not heard_from_1:
            for out in engine.step():
                heard_from_1 |= out.replica == 1
                if out.finished:
                    done[out.request_id] = out
        pid = engine._remotes[1].proc.pid
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        done |= _run_until_done(engine, [r for r in ids if r not in done])
        assert time.monotonic() - t0 < 30
        lost = [rid for rid in ids if done[rid].error is not None]
        assert lost and all(owner[rid] == 1 for rid in lost)
        for i, rid in enumerate(ids):
            out = done[rid]
            if rid in lost:
                assert out.finish_reason == "error" and out.replica == 1
                assert "data-parallel replica 1" in (out.error or ""), out.error
                assert ("exited" in out.error) if how == "killed" else \
                    ("sent nothing for parallel.timeout_s=3" in out.error)
            else:  # greedy: its first 24 tokens are the 24-token run's
                assert out.token_ids[:24] == single[i] and len(out.token_ids) == 200
        states = engine.replica_states()
        assert [s.up for s in states] == [True, False]
        assert "data-parallel replica 1" in (states[1].down or "")
        assert states[0].stats.num_used_blocks == 0  # nothing left behind on the survivor
        # The process is gone (killed even when it only hung), and new work goes to the
        # survivor and gives one engine's tokens.
        assert engine._remotes[1].proc.poll() is not None
        again = [engine.add_request(p, PARAMS) for p in prompts[:3]]
        assert {engine._owner[r] for r in again} == {0}
        done = _run_until_done(engine, again)
        assert [done[r].token_ids for r in again] == single[:3]
        assert engine.replica_states()[0].stats.num_used_blocks == 0
    finally:
        engine.shutdown()


def test_below_min_replicas_the_run_stops_naming_the_replica(
        checkpoint: Path, prompts: list[list[int]]) -> None:
    overrides = [*ENGINE, "parallel.dp=2", f"model.path={checkpoint}"]
    run = resolve_run(load_config(overrides).runtime, env=None, announce=False)
    with pytest.raises(ValueError, match=r"serve.min_replicas=3: allowed is 1..parallel.dp=2"):
        make_engine(run, progress=False, min_replicas=3)
    engine = make_engine(run, progress=False, min_replicas=2)
    try:
        for p in prompts:
            engine.add_request(p, PARAMS)
        os.kill(engine._remotes[1].proc.pid, signal.SIGKILL)
        with pytest.raises(RankFailure, match=r"data-parallel replica 1 .*exited.*1 of 2 "
                                              r"replicas left, 2 needed"):
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.shutdown()
