"""Self-spawned replicas on one node's GPUs: each its own consecutive GPUs, replica 0 the
first ones; too few GPUs is an error naming both counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshserve.engine.replicas.data_parallel import _replica_envs
from meshserve.engine.replicas.gpus import VISIBLE, replica_env, replica_gpus, visible_gpus


def test_each_replica_takes_the_next_gpus_in_order() -> None:
    assert replica_gpus([1, 1], ["0", "1"]) == [["0"], ["1"]]
    assert replica_gpus([2, 1, 1], ["4", "5", "6", "7"]) == [["4", "5"], ["6"], ["7"]]
    assert replica_gpus([2, 2], ["GPU-a", "GPU-b", "GPU-c", "GPU-d", "GPU-e"]) == [
        ["GPU-a", "GPU-b"], ["GPU-c", "GPU-d"]]  # (one left over, unused)


def test_too_few_gpus_names_the_replicas_and_what_is_seen() -> None:
    with pytest.raises(ValueError, match=r"parallel.dp: 2 replicas of 2\+1 ranks need 3 GPUs"
                                         r".*sees 2 \(0,1\).*at most 2"):
        replica_gpus([2, 1], ["0", "1"])
    with pytest.raises(ValueError, match=r"sees 0 \(none\)"):
        replica_gpus([1, 1], [])


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VISIBLE, "3, 1,")
    assert visible_gpus() == ["3", "1"]
    monkeypatch.setenv(VISIBLE, "")
    assert visible_gpus() == []
    assert replica_env(["1"])[VISIBLE] == "1"


def _run(device_type: str, tp: int, pp: int = 1) -> SimpleNamespace:
    par = SimpleNamespace(world_size=tp * pp)
    return SimpleNamespace(device_type=device_type, config=SimpleNamespace(parallel=par))


def test_replica_processes_see_only_their_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VISIBLE, "0,1,2,3")
    envs = _replica_envs([_run("cuda", 2), _run("cuda", 1), _run("cuda", 1)])
    assert [e[VISIBLE] if e else None for e in envs] == ["0,1", "2", "3"]
    assert _replica_envs([_run("cpu", 1), _run("cpu", 1)]) == [None, None]
