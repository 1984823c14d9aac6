"""A Hugging Face tokenizer.json through the `tokenizers` library, with chat templates."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from meshserve.models.arch import CheckpointError
from meshserve.models.chat_template import ChatTemplate

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
"""The special tokens a chat template sees by name, as transformers passes them."""


class Tokenizer:
    """Encode / decode text and render the model's chat template."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing file (needed to turn text into tokens; "
                                  "pass token ids instead)")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception subclass
            raise CheckpointError(f"{path}: cannot be parsed ({e})") from None
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = _chat_template(Path(model_dir), cfg)
        self._compiled: ChatTemplate | None = None
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.special_tokens = {name: text for name in SPECIAL_TOKENS
                               if (text := _token_text(cfg.get(name))) is not None}
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, special ones included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with BOS when the tokenizer config asks for it)."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and (
                not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` (and `tools=`, `documents=`, ...) with the model's chat template,
        sandboxed; ChatTemplateError (a ValueError) says why it could not."""
        if self.chat_template is None:
            raise ValueError("messages: this model's tokenizer has no chat_template; allowed is "
                             "a plain prompt")
        if self._compiled is None:
            self._compiled = ChatTemplate(self.chat_template, self.special_tokens)
        return self._compiled.render(messages, add_generation_prompt=add_generation_prompt,
                                     **kwargs)


def _chat_template(model_dir: Path, cfg: Mapping[str, Any]) -> str | list[Any] | None:
    """The chat template as transformers finds it: chat_template.jinja beside the tokenizer,
    else chat_template.json, else tokenizer_config.json's `chat_template`."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = model_dir / "chat_template.json"
    if js.is_file():
        return json.loads(js.read_text()).get("chat_template")
    return cfg.get("chat_template") or None


def _token_text(tok: object) -> str | None:
    if isinstance(tok, dict):  # {"content": "<s>", ...} in older tokenizer configs
        return str(tok.get("content"))
    return tok if isinstance(tok, str) else None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        # A few prompt tokens give the first output token its left context (spaces, merges).
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (may be '' mid-character)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
