"""The disagg group: presets, overrides and the errors that name the field."""

from __future__ import annotations

import pytest

from meshserve.engine.auto_layout import disagg_layout
from meshserve.engine.disagg import _may_hop
from meshserve.engine.disagg_config import DisaggConfig, PhaseLayout
from meshserve.engine.kv_transfer import FAULT_ENV, decode_params, fault_delays
from meshserve.engine.runtime_config import load_runtime_config
from meshserve.engine.sampling_params import SamplingParams, StructuredOutputs


def test_presets_and_overrides() -> None:
    assert not load_runtime_config().disagg.enabled
    d = load_runtime_config(["disagg=manual", "disagg.decode.replicas=3",
                             "disagg.connector=torch"]).disagg
    assert d.enabled and d.num_replicas == 4 and d.connector == "torch"
    assert load_runtime_config(disagg={"kv_lease_s": 2.5}).disagg.kv_lease_s == 2.5


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"mode": "auto"}, "disagg.mode"),
    ({"connector": "rdma"}, "disagg.connector"),
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
    with pytest.raises(ValueError, match=r"disagg\.prefill\.tp=2.*under a launcher"):
        disagg_layout(config, launched=True)


def test_a_bad_override_names_the_key() -> None:
    with pytest.raises(ValueError, match="disagg.connector"):
        load_runtime_config(["disagg.connector=carrier-pigeon"])


def test_fault_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "want=1.5,pull=0.25")
    assert fault_delays() == {"want": 1.5, "pull": 0.25}
    monkeypatch.setenv(FAULT_ENV, "send=1")
    with pytest.raises(ValueError, match="allowed: want=S, pull=S"):
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
