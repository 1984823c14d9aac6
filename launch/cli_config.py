"""The CLI's configuration: conf/ presets and Hydra overrides composed into a CliConfig."""

from __future__ import annotations

from collections.abc import Sequence

from meshserve.compose import CONF_DIR, GROUPS, ConfigError, compose_config, presets
from meshserve.launch.options import CliConfig

__all__ = ["CONF_DIR", "GROUPS", "CliConfig", "ConfigError", "load_config", "presets"]


def load_config(overrides: Sequence[str] = ()) -> CliConfig:
    """Compose conf/config.yaml with Hydra `overrides` into a validated CliConfig."""
    return compose_config(CliConfig, overrides)
