"""Chat templates in the sandbox: the helpers published templates call, refusals of
Python internals, named templates and where a model directory keeps its template."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from meshserve.models.chat_template import ChatTemplate, ChatTemplateError

HI = [{"role": "user", "content": "hi"}]


def render(source: str, messages=HI, **kw) -> str:
    return ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"}).render(messages, **kw)


def test_helpers_templates_call() -> None:
    assert render("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}") == "<s>hi"
    assert render("{{ {'k': 'é'} | tojson }}") == '{"k": "é"}'
    assert render("{{ [1, 2] | tojson(indent=2) }}") == "[\n  1,\n  2\n]"
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    loops = "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}" \
            "{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert render(loops) == "02"
    ns = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}" \
         "{% endfor %}{{ ns.n }}"
    assert render(ns) == "1"
    assert render("{{ dict(a=1)['a'] }}") == "1"
    assert render("{% if tools %}{{ tools[0].function.name }}{% endif %}",
                  tools=[{"type": "function", "function": {"name": "f"}}]) == "f"
    assert render("{{ documents | length }}", documents=[{"title": "t", "text": "x"}]) == "1"
    assert render("{{ extra }}", extra="kw") == "kw"


def test_raise_exception_carries_the_templates_message() -> None:
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")


@pytest.mark.parametrize("attack", [
    "{{ raise_exception.__globals__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch /tmp/pwned') }}",
    "{% set ns = namespace(__class__=1) %}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update(role='system') }}",
])
def test_python_internals_are_refused(attack: str, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="refused|undefined|namespace"):
        render(attack)
    assert not Path("/tmp/pwned").exists()


def test_none_values_are_dropped_and_syntax_errors_named() -> None:
    src = "{% for m in messages %}{{ 'content' in m }}{% endfor %}"
    assert render(src, [{"role": "assistant", "content": None}]) == "False"
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_named_templates_pick_tool_use_with_tools() -> None:
    t = ChatTemplate([{"name": "default", "template": "plain"},
                      {"name": "tool_use", "template": "tools"}])
    assert t.render(HI) == "plain"
    assert t.render(HI, tools=[{"type": "function", "function": {"name": "f"}}]) == "tools"


def test_a_model_directory_keeps_its_template_where_transformers_looks(
        tmp_path: Path, text_checkpoint: Path) -> None:
    from meshserve.models.tokenizer import Tokenizer

    src = text_checkpoint
    d = tmp_path / "m"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "from-config"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(d).apply_chat_template(HI) == "from-config"
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "from-json"}))
    assert Tokenizer(d).apply_chat_template(HI) == "from-json"
    (d / "chat_template.jinja").write_text("from-jinja")
    assert Tokenizer(d).apply_chat_template(HI) == "from-jinja"


TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "The city, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["c", "f"]}}}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]
WORDS = ["hello", "Zürich", "日本語", "a \"quoted\" word", "line\nbreak", "{braces}", "<tag>",
         "it's", "  spaced  ", "tab\there", "end."]


def conversations(n: int = 20) -> list[list[dict]]:
    """Seeded conversations: with and without a system turn, several exchanges, and
    tool rounds (an assistant call with object arguments, then the tool's answer); the
    last has two user turns in a row, which Mistral's template refuses."""
    import random

    rng = random.Random(0)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))

    out = []
    for i in range(n):
        conv: list[dict] = []
        if i % 3 == 0:
            conv.append({"role": "system", "content": text()})
        for _ in range(rng.randint(0, 2)):
            conv += [{"role": "user", "content": text()},
                     {"role": "assistant", "content": text()}]
        conv.append({"role": "user", "content": text()})
        if i % 4 == 1:
            call_id = f"call{i:05d}"[-9:].rjust(9, "x")
            conv += [{"role": "assistant", "content": "", "tool_calls": [{
                          "id": call_id, "type": "function", "function": {
                              "name": "get_weather", "arguments": {"city": rng.choice(WORDS)}}}]},
                     {"role": "tool", "tool_call_id": call_id, "content": text()}]
        out.append(conv)
    out.append([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    return out


def hf_render(source: str, conv: list[dict], tools: list[dict] | None) -> str:
    from transformers import PreTrainedTokenizerFast

    from meshserve.models.bundled import BUNDLED_DIR

    hf = PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_DIR / "meshcoder" / "tokenizer.json"),
                                 **SPECIAL)
    hf.chat_template = source
    return hf.apply_chat_template(conv, tools=tools, add_generation_prompt=True,
                                  tokenize=False)


@pytest.mark.parametrize("name", ["llama-3.1", "qwen-2.5", "mistral"])
@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
def test_published_templates_render_as_transformers_does(name: str, with_tools: bool) -> None:
    source = (TEMPLATES / f"{name}.jinja").read_text()
    ours = ChatTemplate(source, SPECIAL)
    tools = TOOLS if with_tools else None
    rendered = refusals = 0
    for conv in conversations():
        try:
            want = hf_render(source, conv, tools)
        except Exception as e:  # noqa: BLE001 - the template refuses this conversation
            with pytest.raises(ChatTemplateError) as refused:
                ours.render(conv, tools=tools)
            assert str(e) in str(refused.value)  # the template's own words
            refusals += 1
            continue
        assert ours.render(conv, tools=tools) == want
        rendered += 1
    assert rendered >= 20, rendered  # most conversations are ones the template takes
    assert refusals == (name == "mistral")  # roles that do not alternate
