"""Data-parallel replicas (parallel.dp) started here: each a whole engine in its own
process, requests routed by parallel.router; the same tokens as one engine, failures
reported, nothing left running after shutdown. (Under a launcher:
tests/launch/test_launched_replicas.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.engine.config.run import Run, resolve_run
from meshserve.engine.replicas.data_parallel import (
    DataParallelEngine,
    replica_run,
    with_step_log_of,
)
from meshserve.launch.cli_config import load_config
from meshserve.parallel.comm.ranks import RankFailure

# Small KV cache and token budget: prompts are chunked and sequences get preempted.
ENGINE = ["parallel=single", "engine.block_size=4", "engine.num_gpu_blocks=28",
          "engine.max_num_batched_tokens=16", "parallel.timeout_s=60", "threads=1"]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (2, 9, 17, 30, 44, 5)]


@pytest.fixture(scope="module")
def single(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(str(checkpoint), overrides=ENGINE, progress=False) as llm:
        return [o.token_ids for o in llm.generate(prompts, PARAMS)]


def _run(overrides: list[str]) -> Run:
    return resolve_run(load_config(overrides), env=None, announce=False)


def test_a_replica_config_has_one_replica_and_its_share_of_the_cores() -> None:
    one = replica_run(_run(["parallel.dp=2", "parallel.tp=2", "device=cpu"])).config
    assert (one.parallel.dp, one.parallel.tp) == (1, 2)
    assert one.threads == max(1, (os.cpu_count() or 1) // 4)
    assert replica_run(_run(["parallel.dp=2", "threads=3"])).config.threads == 3


def test_each_replica_logs_its_steps_to_a_file_of_its_own() -> None:
    run = _run(["engine.step_log=/logs/steps.jsonl", "parallel=single"])
    assert with_step_log_of(run, 0) is run
    assert with_step_log_of(run, 2).config.engine.step_log == "/logs/steps.replica2.jsonl"
    plain = _run(["parallel=single"])
    assert with_step_log_of(plain, 1) is plain


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.dp=2"], ["parallel.dp=2", "parallel.tp=2"],
                                    ["parallel=auto", "cluster=local-cpu"]],
                         ids=["dp2", "dp2-tp2", "auto-plans-two-replicas"])
def test_replicas_give_the_tokens_of_one_engine(checkpoint: Path, prompts: list[list[int]],
                                                single: list[list[int]],
                                                layout: list[str]) -> None:
    with LLM(str(checkpoint), overrides=ENGINE + layout, progress=False) as llm:
        engine = llm.engine
        assert isinstance(engine, DataParallelEngine)
        outs = llm.generate(prompts, PARAMS)
        assert [o.token_ids for o in outs] == single
        assert engine.requests_per_replica == [3, 3]  # equal work, split evenly
        stats = engine.stats
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert stats.prefix_cache.num_queries > 0
        assert engine.reset_prefix_cache() >= 0
        remote = engine._remotes[1].proc
    assert remote.poll() is not None  # the replica process is gone


@pytest.mark.slow
def test_bad_input_aborts_and_a_dead_replica(checkpoint: Path, prompts: list[list[int]]) -> None:
    with LLM(str(checkpoint), overrides=ENGINE + ["parallel.dp=2"], progress=False) as llm:
        engine = llm.engine
        with pytest.raises(ValueError, match="prompt_token_ids"):
            engine.add_request([1, 999999], PARAMS)
        assert not engine.has_unfinished()
        a = engine.add_request(prompts[4], PARAMS)
        b = engine.add_request(prompts[4], PARAMS)  # the other replica
        assert engine.abort(b) and not engine.abort(b)
        done = []
        while engine.has_unfinished():
            done += [o.request_id for o in engine.step() if o.finished]
        assert done == [a]
        os.kill(engine._remotes[1].proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"data-parallel replica 1 \(pid \d+\)"):
            engine.add_request(prompts[0], PARAMS)
            engine.add_request(prompts[1], PARAMS)  # to the dead replica
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_a_stopped_replica_is_reported_in_bounded_time(checkpoint: Path,
                                                        prompts: list[list[int]]) -> None:
    overrides = [*ENGINE[:4], "threads=1", "parallel.timeout_s=3", "parallel.dp=2"]
    with LLM(str(checkpoint), overrides=overrides, progress=False) as llm:
        engine = llm.engine
        pid = engine._remotes[1].proc.pid
        time.sleep(2.5)  # idle longer than a heartbeat: no false alarm on an idle replica
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RankFailure, match=r"sent nothing for parallel.timeout_s=3"):
                for p in prompts[:4]:
                    engine.add_request(p, PARAMS)
                while engine.has_unfinished():
                    engine.step()
            assert time.monotonic() - t0 < 15
        finally:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_the_cache_aware_router_keeps_each_prefix_on_one_replica(checkpoint: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    systems = [torch.randint(0, 320, (24,), generator=gen).tolist() for _ in range(2)]
    prompts = [systems[(i // 2) % 2] + torch.randint(0, 320, (3,), generator=gen).tolist()
               for i in range(8)]
    engine_kw = [*ENGINE[:2], "engine.num_gpu_blocks=64", *ENGINE[3:]]
    with LLM(str(checkpoint), overrides=engine_kw, progress=False) as llm:
        want = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    outs = {}
    for router in ("cache_aware", "round_robin"):
        with LLM(str(checkpoint), overrides=[*engine_kw, "parallel.dp=2",
                                             f"parallel.router={router}"],
                 progress=False) as llm:
            engine = llm.engine
            assert isinstance(engine, DataParallelEngine)
            outs[router] = [o.token_ids for o in llm.generate(prompts, PARAMS)]
            hits = engine.stats.prefix_cache.num_hits
            if router == "cache_aware":  # the two tenants, one replica each
                assert engine.requests_per_replica == [4, 4]
                assert engine.router.num_cache_routed == 6
                cache_aware_hits = hits
            else:  # alternating: each replica sees both system prompts
                assert hits < cache_aware_hits
    assert outs["cache_aware"] == outs["round_robin"] == want
