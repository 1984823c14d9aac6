"""The layering contracts in pyproject.toml ([tool.importlinter]) hold, and they bite: a
runtime module that imports the CLI breaks them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.package_copy import copy_of_the_package

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports over the `meshserve` package found first on the path from `cwd`."""
    return subprocess.run([str(LINT), "--config", str(cwd / "meshserve" / "pyproject.toml"),
                           "--no-cache"], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_the_contracts_hold(tmp_path: Path) -> None:
    copy_of_the_package(tmp_path)
    out = lint(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 kept, 0 broken" in out.stdout, out.stdout


def test_a_runtime_import_of_the_cli_breaks_them(tmp_path: Path) -> None:
    pkg = copy_of_the_package(tmp_path)
    scheduler = pkg / "engine" / "core" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\nfrom meshserve.launch import cli  # noqa\n")
    out = lint(tmp_path)
    assert out.returncode != 0, out.stdout
    assert "meshserve.engine.core.scheduler -> meshserve.launch.cli" in out.stdout, out.stdout
    assert "2 kept, 2 broken" in out.stdout, out.stdout


def test_a_room_importing_upwards_breaks_them(tmp_path: Path) -> None:
    """Inside the engine, the scheduler (core/) may not reach the worker, even from inside
    a function."""
    pkg = copy_of_the_package(tmp_path)
    scheduler = pkg / "engine" / "core" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\n\ndef _late() -> None:\n"
                         "    from meshserve.engine.worker import worker  # noqa\n")
    out = lint(tmp_path)
    assert out.returncode != 0, out.stdout
    assert "meshserve.engine.core.scheduler -> meshserve.engine.worker.worker" in out.stdout
    assert "3 kept, 1 broken" in out.stdout, out.stdout
