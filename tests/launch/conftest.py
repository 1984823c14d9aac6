"""Fixtures of the launch tests: a 3-layer text checkpoint and what one process prints."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pytest

from meshserve.launch import generate


@pytest.fixture(scope="session")
def text3(make_checkpoint, text_checkpoint: Path, tmp_path_factory) -> Path:
    """A 3-layer random Llama with the tiny BPE tokenizer (text prompts, 3 stages)."""
    path = tmp_path_factory.mktemp("text3")
    shutil.copytree(make_checkpoint("llama", seed=5, num_hidden_layers=3), path,
                    dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text_checkpoint / name, path / name)
    return path


@pytest.fixture(scope="session")
def one_rank_output(text3: Path) -> list[str]:
    """What one process prints, less the speed line."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert generate.run([f"model.path='{text3}'", "generate.max_tokens=8",
                             "parallel=single"]) == 0
    return printed(buf.getvalue())


def printed(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if not line.startswith("===")]


@pytest.fixture(scope="session", name="printed")
def printed_fixture() -> object:
    """`printed(stdout)`: what a run printed, less its speed line."""
    return printed
