"""One way to reject a user's value: name the field, the value and what is allowed."""

from __future__ import annotations


def require(ok: bool, field: str, value: object, allowed: str) -> None:
    """Raise ValueError naming `field`, the `value` given and what is `allowed`, unless `ok`."""
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid: allowed is {allowed}")
