"""parallel=auto at startup: the planner's tp x pp for the launched ranks or the cluster."""

from __future__ import annotations

import pytest

from meshserve import LLM, SamplingParams
from meshserve.engine.config.auto_layout import resolve_layout
from meshserve.launch.cli_config import load_config
from meshserve.models.arch import ModelArch
from meshserve.models.bundled import resolve_model_dir
from meshserve.parallel.comm.discovery import LaunchEnv
from meshserve.parallel.planner.search import plan_for


def launched(nodes: int, per_node: int, world: int | None = None) -> LaunchEnv:
    return LaunchEnv(launcher="slurm", rank=0, world_size=world or nodes * per_node,
                     local_rank=0, local_world_size=per_node, node_rank=0, num_nodes=nodes,
                     master_addr="127.0.0.1", master_port=29500)


@pytest.fixture(scope="module")
def arch() -> ModelArch:
    return ModelArch.from_dir(resolve_model_dir("meshcoder", None))


def test_auto_uses_every_launched_rank_with_tp_inside_a_node(arch: ModelArch) -> None:
    cfg = resolve_layout(load_config(["parallel=auto"]), arch, launched(2, 2), "cpu",
                         announce=False)
    p = cfg.parallel
    assert (p.auto, p.tp * p.pp, p.dp) == (False, 4, 1)
    assert p.tp <= 2  # local-cpu's domain is one node's 2 ranks


def test_auto_without_a_launcher_stays_within_the_cluster(arch: ModelArch) -> None:
    cfg = resolve_layout(load_config(["parallel=auto"]), arch, None, "cpu", announce=False)
    assert cfg.parallel.tp * cfg.parallel.pp <= cfg.cluster.num_devices
    assert cfg.parallel.dp == 1


def test_fixed_degrees_are_kept(arch: ModelArch) -> None:
    cfg = load_config(["parallel.tp=2"])
    assert resolve_layout(cfg, arch, launched(1, 2), "cpu") is cfg


def test_uneven_nodes_are_refused_naming_the_launch(arch: ModelArch) -> None:
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        resolve_layout(load_config(["parallel=auto"]), arch, launched(2, 2, world=3), "cpu")


def test_a_gpu_preset_on_a_cpu_run_is_refused_naming_both(arch: ModelArch) -> None:
    with pytest.raises(ValueError, match=r"cluster=dgx-h100 describes cuda devices but this "
                                         r"run's device is cpu"):
        resolve_layout(load_config(["cluster=dgx-h100", "device=cpu"]), arch, None, "cpu")


@pytest.mark.slow
def test_the_default_layout_is_the_planners_and_gives_one_ranks_tokens(arch: ModelArch) -> None:
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 17]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM("meshcoder", overrides=["threads=1", "engine.max_model_len=256"],
             progress=False) as auto:
        chosen = plan_for(load_config(["threads=1"]), arch, max_dp=None, fill_cluster=False)
        p = auto.config.parallel
        assert (p.auto, p.tp, p.pp, p.dp) == (False, chosen.tp, chosen.pp, chosen.dp)
        got = [o.token_ids for o in auto.generate(prompts, params)]
    with LLM("meshcoder", overrides=["threads=1", "parallel=single"], progress=False) as one:
        assert [o.token_ids for o in one.generate(prompts, params)] == got
