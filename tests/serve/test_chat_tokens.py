"""A chat prompt's token ids are transformers' apply_chat_template(tokenize=True)'s: the
template writes its own special tokens (a BOS among them) and encoding adds none, for the
bundled template, a Llama-3-style one (BOS from the template and from the tokenizer's
post-processor both) and a Qwen2-style one (no BOS)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from meshserve.engine.llm import LLM
from meshserve.models.bundled import BUNDLED_DIR
from meshserve.models.tokenizer import Tokenizer
from meshserve.serve.serve_config import ServeConfig

from .test_app import KEY, with_app

MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Sort a list of tuples by their second item."}]
TEXT = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
QWEN2 = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer_dir(path: Path, specials: list[str], bos: str | None, template: str) -> Path:
    """A byte-level BPE with `specials`; with `bos`, a post-processor that prepends it."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
        "eos_token": specials[1], "chat_template": template}))
    return path


def _dirs(tmp: Path) -> dict[str, Path]:
    bundled = tmp / "bundled"
    bundled.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_DIR / "meshcoder" / name, bundled / name)
    return {"bundled": bundled,
            "llama3": _tokenizer_dir(tmp / "llama3", [
                "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
                "<|begin_of_text|>", LLAMA3),
            "qwen2": _tokenizer_dir(tmp / "qwen2", ["<|endoftext|>", "<|im_end|>",
                                                    "<|im_start|>"], None, QWEN2)}


@pytest.mark.parametrize("kind", ["bundled", "llama3", "qwen2"])
def test_chat_ids_equal_transformers(tmp_path: Path, kind: str) -> None:
    from transformers import AutoTokenizer

    path = _dirs(tmp_path)[kind]
    ours = Tokenizer(path)
    ids = ours.encode(ours.apply_chat_template(MESSAGES), add_special_tokens=False)
    want = AutoTokenizer.from_pretrained(path).apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert ids == want
    if kind != "qwen2":  # one BOS, the template's
        assert ids[0] == ours.bos_token_id and ids[1] != ours.bos_token_id


def test_served_chat_counts_transformers_prompt_tokens(offline: LLM) -> None:
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(BUNDLED_DIR / "meshcoder").apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)

    async def check(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                              json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)

    asyncio.run(with_app(offline, ServeConfig(), KEY, check))
