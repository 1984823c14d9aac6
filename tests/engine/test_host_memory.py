"""glibc's malloc thresholds are raised once per process on Linux (CPU inference)."""

from __future__ import annotations

import sys

import pytest

from meshserve.engine.host_memory import tune_malloc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tune_malloc_applies_and_is_idempotent() -> None:
    assert tune_malloc() is True
    assert tune_malloc() is True
