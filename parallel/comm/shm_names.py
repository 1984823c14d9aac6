"""Names of the shared-memory files meshserve makes, all under one prefix.

Every file is `SHM_DIR/<prefix>-<kind>-<unique part>`, the prefix `meshserve` unless
MESHSERVE_SHM_PREFIX says otherwise: two services (or two test workers) on one host then
each find, count and sweep only their own files. Child processes inherit the variable.
"""

from __future__ import annotations

import os
import uuid

SHM_DIR = "/dev/shm"
"""Where the files live (Linux's memory-backed file system)."""

PREFIX_ENV = "MESHSERVE_SHM_PREFIX"
"""Overrides the prefix of every shared-memory file name."""


def shm_prefix() -> str:
    """The prefix of this process's shared-memory file names."""
    return os.environ.get(PREFIX_ENV) or "meshserve"


def shm_path(kind: str) -> str:
    """A fresh file path for a segment of `kind` (ar, p2p, ...)."""
    return f"{SHM_DIR}/{shm_prefix()}-{kind}-{uuid.uuid4().hex[:16]}"
