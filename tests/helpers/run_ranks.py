"""Run a program as n processes, each a rank: argv is its rank and a file store path."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

RunRanks = Callable[[str, int, float], list[str]]


def ranks_runner(tmp_path: Path) -> RunRanks:
    """run(program, n, timeout_s): run `program` as n processes (argv: rank, a file store
    path under `tmp_path`); each must exit 0 printing 'ok <rank>'. Returns their stderr."""

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
