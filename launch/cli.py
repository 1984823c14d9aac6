"""The `meshserve` command."""
from __future__ import annotations
import sys
def main(argv: list[str] | None = None) -> int:
    print("meshserve", sys.argv)
    return 0
