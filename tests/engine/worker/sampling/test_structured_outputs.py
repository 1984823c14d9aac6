"""Structured outputs: every completion follows its JSON schema, regex, choice or grammar,
constrained and free requests share steps, and the layouts and modes agree."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshserve import LLM, SamplingParams
from meshserve.engine.core.sampling_params import StructuredOutputs

BACKENDS = ["xgrammar", "llguidance"]
ONE_RANK = ["parallel=single", "threads=1", "model.dtype=float32"]  # layouts agree in fp32
PROMPT = "config = "


def leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
        st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.just({"type": "boolean"}),
        st.lists(st.text("abcxyz_", min_size=1, max_size=5), min_size=1, max_size=4,
                 unique=True).map(lambda e: {"type": "string", "enum": e}),
        st.just({"type": "null"}),
    )


def objects(values: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    names = st.text("abcdefghij", min_size=1, max_size=6)
    return st.dictionaries(names, values, min_size=1, max_size=4).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


def schemas() -> st.SearchStrategy[dict]:
    inner = st.one_of(leaf(), st.tuples(leaf(), st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}))
    return objects(st.one_of(inner, objects(leaf())))


def constrained(max_tokens: int = 200, temperature: float = 0.0, seed: int | None = None,
                **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputs(**kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request):
    engine = LLM("meshcoder", overrides=[*ONE_RANK,
                                         f"engine.structured_outputs_backend={request.param}"],
                 progress=False)
    yield engine
    engine.shutdown()


@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(schemas(), min_size=50, max_size=50))
def test_fifty_generated_schemas_all_parse_and_validate(llm, batch: list[dict]) -> None:
    """All 50 in one batch with free requests beside them; greedy and sampled."""
    params = [constrained(json=s, temperature=0.0 if i % 2 else 0.9, seed=i)
              for i, s in enumerate(batch)]
    free = SamplingParams(max_tokens=24, temperature=0.0)
    outs = llm.generate([PROMPT] * 50 + [PROMPT], [*params, free])
    for schema, out in zip(batch, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    alone = llm.generate([PROMPT], free)[0]
    assert outs[-1].token_ids == alone.token_ids  # the free request is untouched


def test_regex_choice_and_grammar(llm) -> None:
    outs = llm.generate([PROMPT] * 4, [
        constrained(regex=r"[0-9]{3}-[a-z]{2,4}"),
        constrained(choice=["yes", "no", "maybe so"], temperature=1.0, seed=3),
        constrained(grammar='root ::= "def " [a-z]+ "(" [a-z]* "):"'),
        constrained(json_object=True, max_tokens=64, temperature=0.0),
    ])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[0].text), outs[0].text
    assert outs[1].text in ("yes", "no", "maybe so")
    assert re.fullmatch(r"def [a-z]+\([a-z]*\):", outs[2].text), outs[2].text
    assert outs[3].text.startswith("{")
    choices = {llm.generate([PROMPT], constrained(choice=["yes", "no", "maybe so"],
                                                  temperature=1.0, seed=s))[0].text
               for s in range(12)}
    assert choices <= {"yes", "no", "maybe so"} and len(choices) >= 2


@pytest.mark.parametrize("spec, words", [
    (dict(json={"type": "strin"}), "strin"), (dict(regex="[a-"), "regex"),
    (dict(grammar="root ::= ( "), "grammar"),
])
def test_what_cannot_compile_is_refused_naming_the_field(llm, spec: dict, words: str) -> None:
    if llm.engine.run.config.engine.structured_outputs_backend == "llguidance" and \
            "grammar" in spec:
        spec = dict(grammar="root ::= [a-")
    with pytest.raises(ValueError, match=rf"^structured_outputs: .*{words}|^structured_outputs:"):
        llm.generate([PROMPT], constrained(**spec))
    assert llm.engine.stats.num_free_blocks == llm.engine.num_blocks


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb"]}, "maxItems": 3},
    "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "tags", "n"], "additionalProperties": False}
LAYOUTS = {
    "async": [*ONE_RANK, "engine.async_scheduling=true"],
    "preempt": [*ONE_RANK, "engine.block_size=4", "engine.num_gpu_blocks=16"],
    "chunk-5": [*ONE_RANK, "engine.max_num_batched_tokens=5"],
    "tp2": ["parallel.tp=2", "model.dtype=float32"],
    "pp2": ["parallel.pp=2", "model.dtype=float32"],
}


@pytest.fixture(scope="module")
def reference() -> list[str]:
    llm = LLM("meshcoder", overrides=ONE_RANK, progress=False)
    try:
        return [o.text for o in llm.generate(_layout_prompts(), _layout_params())]
    finally:
        llm.shutdown()


def _layout_prompts() -> list[str]:
    return [PROMPT, "def f(x):", "x = ", "import os\n" * 2]


def _layout_params() -> list[SamplingParams]:
    return [constrained(json=SCHEMA, max_tokens=48), SamplingParams(max_tokens=20, temperature=0.0),
            constrained(regex=r"[a-z]{2,6}\.[0-9]", max_tokens=20),
            constrained(json=SCHEMA, temperature=0.8, seed=11, max_tokens=48)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_and_mode_constrains_the_same(layout: str, reference: list[str]) -> None:
    """The sampling rank applies the masks: TP (the driver), PP (the last stage), async
    scheduling, preemption and chunked prefill give the single rank's tokens."""
    llm = LLM("meshcoder", overrides=LAYOUTS[layout], progress=False)
    try:
        outs = llm.generate(_layout_prompts(), _layout_params())
        assert [o.text for o in outs] == reference
        jsonschema.validate(json.loads(outs[0].text), SCHEMA)
        assert llm.engine.stats.num_free_blocks == llm.engine.num_blocks
        if layout == "preempt":
            assert llm.engine.stats.num_preemptions > 0
    finally:
        llm.shutdown()
