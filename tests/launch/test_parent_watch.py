"""A self-spawned rank whose driver is gone leaves at once, with one line saying why, even
though the watcher that notices runs on its own thread (signal handlers cannot be set
there)."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = r'''
import os, time
from meshserve.engine.executor.rank import _exit_now
from meshserve.parallel.comm.ranks import watch_parent

watch_parent(os.getppid() + 10**7, lambda: _exit_now("meshserve rank 1: the driver is gone", 3))
time.sleep(30)
'''


def test_a_rank_leaves_when_its_parent_watcher_fires() -> None:
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                         timeout=25)
    assert out.returncode == 3, out.stderr[-2000:]
    assert out.stderr.strip() == "meshserve rank 1: the driver is gone"
