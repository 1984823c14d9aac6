"""An offline script under a launcher: `LLM(...).generate(...)` and nothing else (no
shutdown) ends with exit code 0 on every rank, the driver printing the right tokens; a rank
that really fails still fails the job."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

SCRIPT = """
import sys
from meshserve import LLM, SamplingParams
llm = LLM(sys.argv[1], overrides=["parallel.tp=2", "threads=1"], progress=False)
out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True))
print("TOKENS", out[0].token_ids, flush=True)
if len(sys.argv) > 2:  # fail after the work: the job must not read as a success
    raise RuntimeError("the script failed")
"""
HAS_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None


def launchers() -> dict[str, list[str]]:
    """Each launcher's command line up to the script (torchrun runs it with its own
    interpreter, mpirun needs one named)."""
    found = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2"]}
    if HAS_MPI:
        found["mpirun"] = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                           "-x", "OMP_NUM_THREADS=1", sys.executable]
    return found


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "offline.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture(scope="module")
def expected(text3: Path) -> list[int]:
    with LLM(str(text3), overrides=["parallel=single"], progress=False) as llm:
        return llm.generate([[5, 6, 7, 8, 9]], SamplingParams(
            max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("launcher", list(launchers()))
def test_a_script_that_ends_normally_exits_0_on_every_rank(script: Path, text3: Path,
                                                           expected: list[int],
                                                           launcher: str) -> None:
    out = subprocess.run([*launchers()[launcher], str(script), str(text3)],
                         capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("TOKENS") == 1 and f"TOKENS {expected}" in out.stdout
    assert "is gone" not in out.stderr, out.stderr[-3000:]


def test_a_script_that_fails_still_fails_the_job(script: Path, text3: Path) -> None:
    out = subprocess.run([*launchers()["torchrun"], str(script), str(text3), "fail"], capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode != 0
    assert "the script failed" in out.stderr
