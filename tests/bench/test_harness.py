"""The engines' runners in process: arrival times honoured, outputs equal across engines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshserve.bench.harness import MeshserveRunner
from meshserve.bench.metrics import RunResult
from meshserve.bench.peers import load_hf_model, make_peer
from meshserve.bench.rounds import compare_outputs
from meshserve.bench.workloads import BenchRequest
from meshserve.launch.cli_config import load_config

REQS = [BenchRequest(list(range(3, 40)), 6), BenchRequest([7, 8, 9], 2),
        BenchRequest(list(range(50, 70)), 9), BenchRequest(list(range(100, 133)), 4)]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", seed=3)


@pytest.fixture(scope="module")
def meshserve_run(model_dir: Path) -> tuple[MeshserveRunner, RunResult]:
    torch.set_num_threads(1)
    runner = MeshserveRunner(load_config([f"model.path={model_dir}", "threads=1", "parallel=single",
                                          "engine.kv_cache_memory=16777216"]))
    return runner, runner.run(REQS)


def test_meshserve_run_counts_and_cache_figures(meshserve_run: tuple[MeshserveRunner, RunResult]
                                                ) -> None:
    runner, res = meshserve_run
    assert [r.num_generated_tokens for r in res.records] == [6, 2, 9, 4]
    assert [len(r.token_ids) for r in res.records] == [6, 2, 9, 4]
    assert all(0 <= r.arrival <= r.first_token <= r.finish <= res.wall_s for r in res.records)
    assert res.extra["prefill_tokens_computed"] == sum(len(r.prompt_token_ids) for r in REQS)
    assert res.extra["decode_steps"]["num_steps"] >= 1
    again = runner.run(REQS)  # the prefix cache is emptied between runs
    assert again.extra["prefix_cache_hits"] == 0
    assert compare_outputs(res, again)["identical"]


def test_meshserve_honours_arrival_times(meshserve_run: tuple[MeshserveRunner, RunResult]
                                         ) -> None:
    runner, _ = meshserve_run
    late = [REQS[0], BenchRequest(REQS[1].prompt_token_ids, 2, arrival_s=0.3)]
    res = runner.run(late)
    assert res.records[1].arrival == pytest.approx(0.3)
    assert res.records[1].first_token > 0.3 and res.records[0].arrival == 0.0
    assert res.wall_s >= 0.3


@pytest.mark.parametrize("peer", ["hf-static-3", "hf-continuous"])
def test_peers_match_meshserve_token_for_token(model_dir: Path, peer: str,
                                               meshserve_run: tuple[MeshserveRunner, RunResult]
                                               ) -> None:
    model = load_hf_model(model_dir, torch.float32)
    runner = make_peer(peer, model, max_batch_tokens=64, kv_cache_memory=1 << 24)
    res = runner.run(REQS)
    assert res.engine == peer
    assert [r.num_generated_tokens for r in res.records] == [6, 2, 9, 4]
    assert compare_outputs(meshserve_run[1], res)["identical"], compare_outputs(
        meshserve_run[1], res)
    # A static batch runs to its longest request; a short one is done earlier.
    assert all(r.first_token <= r.finish for r in res.records)
    if peer == "hf-static-3":
        assert res.records[1].finish < res.records[2].finish
        assert res.extra["padding_tokens"] == 3 * 9 + 4 - 21
