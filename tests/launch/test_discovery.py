"""Rank discovery from each launcher's variables (the launchers themselves run in
test_slurm.py and test_mpirun.py)."""

from __future__ import annotations

import pytest

from meshserve.parallel.comm.discovery import (
    LaunchError,
    discover,
    expand_hostlist,
    tasks_on_node,
)


def test_no_launcher_means_none() -> None:
    assert discover({"PATH": "/bin", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0"}) is None


def test_torchrun() -> None:
    env = discover({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "n0",
                    "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
                    "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert env is not None
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size,
            env.node_rank, env.num_nodes, env.master_addr, env.master_port, env.agent_store) == (
        "torchrun", 5, 8, 1, 4, 1, 2, "n0", 29500, True)
    assert env.is_worker


def test_deepspeed_launcher() -> None:
    env = discover({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_SIZE": "2",
                    "CROSS_RANK": "1", "CROSS_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
                    "MASTER_PORT": "29500"})
    assert env is not None
    assert (env.launcher, env.node_rank, env.num_nodes, env.local_world_size) == (
        "deepspeed", 1, 2, 2)


def test_slurm_step() -> None:
    env = discover({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "1", "SLURM_PROCID": "3",
                    "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
                    "SLURM_STEP_NODELIST": "localhost", "PMI_RANK": "3"})
    assert env is not None
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size,
            env.node_rank, env.num_nodes, env.master_addr) == (
        "slurm", 3, 4, 1, 2, 1, 2, "localhost")
    assert env.master_port == 20000 + 42 * 10 + 1


def test_slurm_batch_script_is_not_a_launch() -> None:
    """The batch script itself runs as 'task 0' of no step: it launches nothing."""
    assert discover({"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None


@pytest.mark.parametrize(("hostlist", "hosts"), [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[08-10,12],login", ["gpu08", "gpu09", "gpu10", "gpu12", "login"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
])
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


def test_tasks_per_node() -> None:
    assert [tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    with pytest.raises(LaunchError, match="SLURM_NODEID=4"):
        tasks_on_node("2(x3),1", 4)


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "rank=4 is invalid: allowed is 0 <= rank < world size 4"),
    ({"RANK": "x", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "RANK='x' is invalid: allowed is an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR / MASTER_PORT are not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
     "rendezvous port=70000 is invalid"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2",
      "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "local rank=2 is invalid"),
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NODEID": "0",
      "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2",
      "SLURM_STEP_NODELIST": "bad[1-x]"}, "node list 'bad[1-x]' is invalid"),
], ids=["rank-range", "not-int", "no-rendezvous", "port", "local-rank", "hostlist"])
def test_bad_launch_variables_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=message.replace("[", r"\[").replace("(", r"\(")):
        discover(env)
