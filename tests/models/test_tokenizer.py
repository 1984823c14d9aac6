"""Tokenizer: round trips, streaming detokenization, chat templates, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshserve.models.arch import CheckpointError
from meshserve.models.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "def add(a, b):\n    return a + b  # ünïcödé ✓\n"


def test_round_trip(text_checkpoint: Path) -> None:
    tok = Tokenizer(text_checkpoint)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.eos_token_id == tok._tok.token_to_id("<|endoftext|>")


def test_streaming_text_equals_full_decode(text_checkpoint: Path) -> None:
    tok = Tokenizer(text_checkpoint)
    prompt = tok.encode("x = 1\n")
    ids = tok.encode(TEXT)  # multi-byte characters split over several byte-level tokens
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == TEXT == detok.text
    assert "" in deltas  # mid-character tokens wait for the rest of the character


def test_chat_template(text_checkpoint: Path) -> None:
    tok = Tokenizer(text_checkpoint)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "# user: hi\n# assistant:"


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing file"):
        Tokenizer(tmp_path)
