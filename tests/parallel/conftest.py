"""Fixtures of the parallel tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

RunRanks = Callable[[str, int, float], list[str]]


@pytest.fixture
def run_ranks(tmp_path: Path) -> RunRanks:
    """run_ranks(program, n, timeout_s): run `program` as n processes (argv: rank, a file
    store path); each must exit 0 printing 'ok <rank>'. Returns their stderr."""

    def run(program: str, n: int, timeout_s: float) -> list[str]:
        store = tmp_path / "store"
        procs = [subprocess.Popen([sys.executable, "-c", program, str(r), str(store)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(n)]
        outs = [p.communicate(timeout=timeout_s) for p in procs]
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            assert p.returncode == 0 and out.strip() == f"ok {r}", err[-3000:]
        return [err for _, err in outs]

    return run
