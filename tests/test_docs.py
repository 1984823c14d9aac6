"""docs/architecture.md has a line on every module, and names none that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"tests", "docs", "build", ".venv", ".git", "bundled"}


def test_every_module_has_its_line() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^- `([^`]+\.py)`", doc, re.M))
    modules = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
               if not SKIP & set(p.relative_to(ROOT).parts) and p.name != "__init__.py"}
    assert not modules - listed, f"no line in docs/architecture.md: {sorted(modules - listed)}"
    assert not listed - modules, f"gone, still listed: {sorted(listed - modules)}"
