"""The sampling-cost benchmark's pieces run and measure what they say."""

from __future__ import annotations

from meshserve.bench.sampling_cost import mask_us, step_ms
from meshserve.engine.llm import LLM


def test_each_case_decodes_the_same_steps() -> None:
    llm = LLM("meshcoder", overrides=["parallel=single", "threads=1"], progress=False)
    try:
        for kind in ("free", "constrained", "penalized"):
            assert step_ms(llm, 2, 6, kind) > 0  # asserts every request ran all 6 tokens
        assert mask_us(llm, 2, steps=3) > 0
    finally:
        llm.shutdown()
