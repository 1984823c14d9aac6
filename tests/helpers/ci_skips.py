"""Under CI=true a skipped test fails the run, naming why it skipped, unless it needs a GPU
(marked `gpu`, or skipped for want of CUDA): the CI machine is expected to run everything
else (Slurm, MPI, the C kernels, shared memory), so a failed install cannot pass for green."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped test gave."""
    text = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return text.removeprefix("Skipped: ")


def expected_to_run(item: pytest.Item, reason: str) -> bool:
    """Whether the CI machine should have run this test (everything but GPU tests)."""
    return item.get_closest_marker("gpu") is None and "CUDA" not in reason


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]
                              ) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if (os.environ.get("CI", "").lower() != "true" or not report.skipped
            or hasattr(report, "wasxfail")):
        return
    reason = skip_reason(report)
    if expected_to_run(item, reason):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where it is expected to run: {reason}"
