"""MESHSERVE_CPU_ISA: the path is chosen from the CPU's flags, forcing one the CPU lacks is
an error naming the flags, and the other build (AVX2 on an AVX-512 machine) passes the
same kernel tests against torch."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshserve.kernels import cpu_isa, native_cpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_isa(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """cpu_isa.selected re-read under the test's environment, and again after it."""
    cpu_isa.selected.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    cpu_isa.selected.cache_clear()


def test_auto_takes_the_widest_path_the_flags_allow(fresh_isa: pytest.MonkeyPatch) -> None:
    fresh_isa.delenv(cpu_isa.ENV_VAR, raising=False)
    want = ("avx512" if cpu_isa.supports("avx512") else
            "avx2" if cpu_isa.supports("avx2") else "none")
    assert cpu_isa.selected() == want
    assert cpu_isa.bf16_batches() == (want == "avx512")


def test_a_bad_value_names_the_variable(fresh_isa: pytest.MonkeyPatch) -> None:
    fresh_isa.setenv(cpu_isa.ENV_VAR, "sse9")
    with pytest.raises(ValueError, match=r"MESHSERVE_CPU_ISA='sse9' is invalid: allowed are"):
        cpu_isa.selected()


def test_forcing_a_missing_path_names_the_flags(fresh_isa: pytest.MonkeyPatch) -> None:
    fresh_isa.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    fresh_isa.setenv(cpu_isa.ENV_VAR, "avx512")
    with pytest.raises(ValueError, match=r"lacks avx512bw, avx512vl, avx512_bf16; allowed"):
        cpu_isa.selected()
    fresh_isa.setenv(cpu_isa.ENV_VAR, "avx2")
    assert cpu_isa.selected() == "avx2"


def test_each_path_has_its_own_build(tmp_path: Path) -> None:
    assert native_cpu.ISA_FLAGS["avx2"][0] == "-march=haswell"  # no AVX-512 code
    assert set(native_cpu.ISA_FLAGS) == {*cpu_isa.ISAS[1:], "none"}


@pytest.mark.skipif(native_cpu.library() is None, reason="no C compiler")
@pytest.mark.skipif(not (cpu_isa.selected() == "avx512" and cpu_isa.supports("avx2")),
                    reason="needs a CPU with both paths (this one runs only one)")
def test_the_avx2_build_passes_the_kernel_tests() -> None:
    """The AVX-512 build runs in every other test of this suite; this runs the C kernels'
    tests once more on the AVX2 build (no oneDNN bf16 either), with the library's own
    threads rather than OpenMP's."""
    # The AVX2 path has no oneDNN bf16, so its oneDNN test skips there by design: the child
    # runs without CI=true (which would fail that skip); this test is the one CI judges.
    # It also takes the other way of splitting work, the library's own threads.
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {cpu_isa.ENV_VAR: "avx2",
                                                              native_cpu.POOL_VAR: "threads"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         "tests/kernels/test_native_cpu.py", "tests/kernels/test_bf16_cpu.py",
         "tests/kernels/test_prefill_attention.py", "tests/models/test_fused_decoder.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
