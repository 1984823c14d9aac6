"""Bytes in and out of a torch.distributed Store.

The Store binding takes bytes as values as readily as str, but torch's type stubs say
str only; these calls say bytes and keep the stubs' complaint in one place.
"""

from __future__ import annotations

from typing import Any, cast

import torch.distributed as dist


def store_set(store: dist.Store, key: str, value: bytes) -> None:
    """`store.set` of a bytes value."""
    cast(Any, store).set(key, value)


def store_compare_set(store: dist.Store, key: str, expected: bytes, desired: bytes) -> bytes:
    """`store.compare_set` of bytes values: the value now under `key`."""
    return bytes(cast(Any, store).compare_set(key, expected, desired))
