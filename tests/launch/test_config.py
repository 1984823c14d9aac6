"""Hydra configuration: presets, overrides, and errors that name the key."""

from __future__ import annotations

import pytest

from meshserve.launch.cli_config import ConfigError, load_config, presets


def test_defaults_compose_into_frozen_dataclasses() -> None:
    cfg = load_config()
    assert cfg.model.name == "meshcoder" and cfg.engine.block_size == 16
    assert cfg.parallel.auto and cfg.scenario.name == "chatbot"  # the planner lays it out
    with pytest.raises(AttributeError):
        cfg.engine.block_size = 32  # type: ignore[misc]


def test_every_group_has_its_presets() -> None:
    assert {"meshcoder", "meshcoder-draft", "llama-3-8b", "llama-3-70b",
            "qwen2-7b"} <= set(presets("model"))
    assert {"chatbot", "codegen", "offline", "rag"} <= set(presets("scenario"))
    assert {"default", "static"} <= set(presets("engine"))
    assert presets("parallel") and presets("cluster")


@pytest.mark.parametrize("scenario", ["chatbot", "codegen", "offline", "rag"])
def test_scenarios_load(scenario: str) -> None:
    assert load_config([f"scenario={scenario}"]).scenario.name == scenario


def test_overrides_apply() -> None:
    cfg = load_config(["model=llama-3-70b", "engine.max_num_seqs=8", "parallel.tp=8",
                       "parallel.pp=2", "engine=static"])
    assert cfg.model.arch is not None and cfg.model.arch["num_hidden_layers"] == 80
    assert cfg.engine.max_num_seqs == 8 and cfg.engine.policy == "static"
    assert cfg.parallel.world_size == 16


@pytest.mark.parametrize("given", [["parallel.tp=2"], ["parallel=auto", "parallel.pp=2"],
                                   ["parallel.dp=1"]])
def test_degrees_given_by_hand_switch_auto_off(given: list[str]) -> None:
    cfg = load_config(given)
    assert not cfg.parallel.auto
    assert load_config(["parallel=single"]).parallel.world_size == 1


@pytest.mark.parametrize(("override", "message"), [
    ("engine.foo=1", r"engine\.foo: unknown key; allowed keys of engine: block_size, "),
    ("nope=1", r"nope: unknown key; allowed keys of the top level: model, engine"),
    ("model=gpt5", r"model=gpt5: no such preset; allowed: llama-3-70b, llama-3-8b, meshcoder"),
    ("engine.max_num_seqs=abc", r"engine\.max_num_seqs=abc: .*could not be converted to Integer"),
    ("engine.block_size=3", r"engine\.block_size=3 is invalid: allowed is a power of two"),
    ("engine.policy=fifo", r"engine\.policy='fifo' is invalid: allowed is one of \('continuous', "
                           r"'static'\)"),
    ("parallel.tp=0", r"parallel\.tp=0 is invalid: allowed is an int >= 1"),
    ("model.dtype=int4", r"model\.dtype='int4' is invalid"),
    ("scenario.objective=fast", r"scenario\.objective='fast' is invalid"),
    ("engine.max_num_seqs", r"expected key=value"),
])
def test_bad_overrides_name_the_key_and_what_is_allowed(override: str, message: str) -> None:
    with pytest.raises(ConfigError if "is invalid" not in message else ValueError,
                       match=message):
        load_config([override])
