"""No module of the package is over MAX_LINES lines: past that, one concept has become two."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
EXEMPT = {"models/bundled/train.py"}  # the bundled model's trainer, run by hand once
SKIP = {"tests", "docs", "build", ".venv", ".git"}


def test_no_module_is_over_max_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if not SKIP & set(p.relative_to(ROOT).parts)
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= EXEMPT, long
