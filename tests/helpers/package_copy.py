"""A copy of the package's Python sources, for tests that break it on purpose."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def copy_of_the_package(tmp: Path) -> Path:
    """The package's Python sources and its pyproject.toml under tmp/meshserve."""
    dst = tmp / "meshserve"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(
        ".git", ".venv", "tests", "docs", "bundled", "__pycache__", "*.egg-info", "*.c",
        "*.json", "*.safetensors"))
    return dst
