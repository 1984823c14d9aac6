"""The `meshserve` command as a user runs it (a subprocess of the installed entry point)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MESHSERVE = str(Path(sys.executable).with_name("meshserve"))


def run(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([MESHSERVE, *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)


def test_help_lists_verbs_and_presets() -> None:
    out = run("--help")
    assert out.returncode == 0, out.stderr
    assert "generate" in out.stdout and "meshcoder" in out.stdout and "chatbot" in out.stdout


def test_generate_prints_completions_and_speed(text_checkpoint: Path, tmp_path: Path) -> None:
    out = run("generate", f"model.path={text_checkpoint}", "generate.prompts=['def add(a, b):']",
              "generate.max_tokens=8", "generate.ignore_eos=true", "engine.max_num_seqs=4",
              cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "--- prompt: 'def add(a, b):'  (length, 8 tokens)" in out.stdout
    assert "generated tok/s" in out.stdout and "TTFT mean" in out.stdout


def test_bad_override_exits_nonzero_naming_the_key(tmp_path: Path) -> None:
    out = run("generate", "engine.max_num_seq=4", cwd=str(tmp_path))
    assert out.returncode == 2
    assert "engine.max_num_seq: unknown key; allowed keys of engine:" in out.stderr
    assert "Traceback" not in out.stderr


def test_missing_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    out = run("generate", f"model.path={tmp_path / 'nowhere'}", cwd=str(tmp_path))
    assert out.returncode == 2
    assert "model.path=" in out.stderr and "no such directory" in out.stderr
