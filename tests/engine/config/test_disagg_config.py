"""The disagg group: presets, overrides and the errors that name the field."""

from __future__ import annotations

import pytest

from meshserve.engine.config.auto_layout import disagg_layout
from meshserve.engine.config.disagg_config import DisaggConfig, PhaseLayout
from meshserve.engine.config.run import resolve_run
from meshserve.engine.config.runtime_config import load_runtime_config
from meshserve.engine.core.sampling_params import SamplingParams, StructuredOutputs
from meshserve.engine.disagg.front import _may_hop
from meshserve.engine.replicas.kv_handoff import FAULT_ENV, decode_params, fault_delays
from meshserve.parallel.comm.discovery import LaunchEnv

SPLITS = ["disagg=auto", "scenario=rag", "scenario.prompt_len=8000", "scenario.output_len=64",
          "scenario.ttft_slo_ms=4000", "scenario.tpot_slo_ms=10"]
"""A scenario whose long prompts under a tight TPOT SLO the planner splits on local-cpu."""


def test_presets_and_overrides() -> None:
    assert not load_runtime_config().disagg.enabled
    d = load_runtime_config(["disagg=manual", "disagg.decode.replicas=3",
                             "disagg.connector=torch"]).disagg
    assert d.enabled and d.num_replicas == 4 and d.connector == "torch"
    assert load_runtime_config(disagg={"kv_lease_s": 2.5}).disagg.kv_lease_s == 2.5


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"mode": "split"}, "disagg.mode"),
    ({"connector": "rdma"}, "disagg.connector"),
    ({"torch_wire": "mpi"}, "disagg.torch_wire"),
    ({"on_failure": "retry"}, "disagg.on_failure"),
    ({"kv_lease_s": 0}, "disagg.kv_lease_s"),
    ({"min_prefill_tokens": -1}, "disagg.min_prefill_tokens"),
    ({"prefill": PhaseLayout(replicas=0)}, "disagg.prefill.replicas"),
    ({"decode": PhaseLayout(tp=0)}, "disagg.decode.tp"),
    ({"prefill": PhaseLayout(pp=-1)}, "disagg.prefill.pp"),
])
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        DisaggConfig(**kwargs)


def test_each_phase_has_its_own_layout() -> None:
    d = DisaggConfig(mode="manual", prefill=PhaseLayout(replicas=2, tp=2),
                     decode=PhaseLayout(pp=2))
    assert d.ranks_per_replica == [2, 2, 2]
    assert d.phase_of(1).tp == 2 and d.phase_of(2).pp == 2
    config = load_runtime_config(["disagg=manual", "disagg.prefill.tp=2"])
    laid = disagg_layout(config)
    assert (laid.parallel.dp, laid.parallel.tp) == (2, 1)  # the phases set each replica's


def test_a_bad_override_names_the_key() -> None:
    with pytest.raises(ValueError, match="disagg.connector"):
        load_runtime_config(["disagg.connector=carrier-pigeon"])


def test_fault_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "held=1.5,pull=0.25")
    assert fault_delays() == {"held": 1.5, "pull": 0.25}
    monkeypatch.setenv(FAULT_ENV, "send=1")
    with pytest.raises(ValueError, match="allowed: held=S, pull=S"):
        fault_delays()


def test_what_hops_and_what_the_decode_side_is_left_with() -> None:
    assert _may_hop(SamplingParams(max_tokens=8, stop=("\n",), repetition_penalty=1.2))
    assert not _may_hop(SamplingParams(max_tokens=1))  # the prefill replica finishes it
    assert not _may_hop(SamplingParams(max_tokens=8, presence_penalty=0.5))
    assert not _may_hop(SamplingParams(max_tokens=8, frequency_penalty=0.5))
    assert not _may_hop(SamplingParams(max_tokens=8,
                                       structured_outputs=StructuredOutputs(regex="[ab]+")))
    rest = decode_params(SamplingParams(max_tokens=8, min_tokens=3, temperature=0.7))
    assert (rest.max_tokens, rest.min_tokens, rest.temperature) == (7, 2, 0.7)
    assert decode_params(SamplingParams(max_tokens=8)).min_tokens == 0


def test_disagg_auto_starts_the_better_kind(capsys: pytest.CaptureFixture[str]) -> None:
    split = resolve_run(load_runtime_config(SPLITS), env=None, max_dp=None).config
    assert split.disagg.mode == "manual" and split.disagg.num_replicas == 2
    assert (split.disagg.prefill.tp, split.disagg.decode.tp) == (1, 1)
    assert split.parallel.dp == 2 and not split.parallel.auto
    assert "disagg=auto chose disaggregated serving" in capsys.readouterr().err
    chat = resolve_run(load_runtime_config(["disagg=auto", "scenario=chatbot"]), env=None,
                       max_dp=None).config
    assert chat.disagg.mode == "none" and not chat.disagg.enabled
    assert chat.parallel.tp * chat.parallel.pp * chat.parallel.dp >= 1
    assert "disagg=auto chose colocated serving" in capsys.readouterr().err


def test_disagg_auto_decides_by_simulation_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    closed = resolve_run(load_runtime_config(SPLITS), env=None, max_dp=None).config
    assert "Simulated goodput" not in capsys.readouterr().err
    simulated = resolve_run(load_runtime_config([*SPLITS, "disagg.simulate=true"]), env=None,
                            max_dp=None).config
    err = capsys.readouterr().err
    assert "Simulated goodput" in err and "disagg=auto chose" in err
    kind = "disaggregated" if simulated.disagg.mode == "manual" else "colocated"
    assert f"disagg=auto chose {kind} serving" in err
    assert closed.disagg.mode == "manual"


def test_disagg_auto_under_a_launcher_splits_every_launched_rank() -> None:
    env = LaunchEnv(launcher="torchrun", rank=0, world_size=4, local_rank=0,
                    local_world_size=4, node_rank=0, num_nodes=1, master_addr="127.0.0.1",
                    master_port=29500)
    cluster = ["cluster.devices_per_node=4", "cluster.nvlink_domain_size=4"]
    config = resolve_run(load_runtime_config([*SPLITS, *cluster]), env=env,
                         max_dp=None, announce=False).config
    d = config.disagg
    assert d.mode == "manual" and sum(d.ranks_per_replica) == 4
