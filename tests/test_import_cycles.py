"""No module of the package imports itself round a circle, not even through an import
inside a function: the rooms' contracts say which way imports go, this says they never
come back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.package_copy import copy_of_the_package

ROOT = Path(__file__).resolve().parents[1]

FIND_CYCLES = """
import sys
import grimp

graph = grimp.build_graph("meshserve", include_external_packages=False, cache_dir=None)
imports = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
order: dict[str, int] = {}
low: dict[str, int] = {}
stack: list[str] = []
on_stack: set[str] = set()
circles: list[list[str]] = []


def visit(root: str) -> None:
    # Tarjan's strongly connected components, iteratively (deep import chains).
    work = [(root, iter(imports[root]))]
    order[root] = low[root] = len(order)
    stack.append(root)
    on_stack.add(root)
    while work:
        module, edges = work[-1]
        for nxt in edges:
            if nxt not in order:
                order[nxt] = low[nxt] = len(order)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(imports[nxt])))
                break
            if nxt in on_stack:
                low[module] = min(low[module], order[nxt])
        else:
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == order[module]:
                circle = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    circle.append(m)
                    if m == module:
                        break
                if len(circle) > 1:
                    circles.append(sorted(circle))


for m in sorted(imports):
    if m not in order:
        visit(m)
for circle in circles:
    print("circle:", " <-> ".join(circle))
sys.exit(1 if circles else 0)
"""


def circles(cwd: Path) -> subprocess.CompletedProcess[str]:
    """The import circles of the `meshserve` package found first on the path from `cwd`."""
    return subprocess.run([sys.executable, "-c", FIND_CYCLES], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_the_package_has_no_import_circle(tmp_path: Path) -> None:
    copy_of_the_package(tmp_path)
    out = circles(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_circle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    pkg = copy_of_the_package(tmp_path)
    blocks = pkg / "engine" / "core" / "block_manager.py"  # the scheduler imports it
    blocks.write_text(blocks.read_text() + "\n\ndef _late() -> None:\n"
                      "    from meshserve.engine.core import scheduler  # noqa\n")
    out = circles(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "meshserve.engine.core.block_manager" in out.stdout, out.stdout
    assert "meshserve.engine.core.scheduler" in out.stdout, out.stdout
