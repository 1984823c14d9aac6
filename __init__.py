"""meshserve: an LLM inference runtime that lays one model out over many GPUs and nodes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from meshserve.engine.core.sampling_params import SamplingParams
    from meshserve.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `meshserve --help` and config tooling don't import torch.
    if name == "LLM":
        from meshserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from meshserve.engine.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'meshserve' has no attribute {name!r}")
