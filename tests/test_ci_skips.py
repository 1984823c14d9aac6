"""Under CI=true, a skip the CI machine should not need fails the run and says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CASES = '''
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="mpirun is not installed")
def test_needs_mpi():
    pass

@pytest.mark.skipif(True, reason="needs CUDA")
def test_needs_a_gpu():
    pass
'''


def run(tmp: Path, ci: str) -> subprocess.CompletedProcess[str]:
    (tmp / "test_cases.py").write_text(CASES)
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(TESTS)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "helpers.ci_skips",
                           "-p", "no:cacheprovider", "-rA", str(tmp / "test_cases.py")],
                          capture_output=True, text=True, cwd=tmp, env=env, timeout=120)


def test_a_skip_fails_under_ci_naming_its_reason(tmp_path: Path) -> None:
    out = run(tmp_path, "true")
    assert out.returncode == 1, out.stdout
    # a skipif skips in setup, so the test reads as an error there
    assert "1 passed, 1 skipped, 1 error" in out.stdout, out.stdout
    assert "expected to run: mpirun is not installed" in out.stdout, out.stdout


def test_skips_stay_skips_outside_ci(tmp_path: Path) -> None:
    out = run(tmp_path, "")
    assert out.returncode == 0, out.stdout
    assert "1 passed, 2 skipped" in out.stdout, out.stdout
