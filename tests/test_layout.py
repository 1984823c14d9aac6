"""Packaging: everything installs under `meshserve.*`, nothing as a bare top-level name."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("parallel", "engine", "models", "kernels", "launch", "bench", "serve")


def py(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_subpackages_import_under_meshserve(tmp_path: Path) -> None:
    code = ("import importlib.util, meshserve\n"
            f"for n in {SUBPACKAGES!r}:\n"
            "    assert importlib.util.find_spec('meshserve.' + n), n\n"
            "    bare = importlib.util.find_spec(n)\n"
            f"    assert bare is None or not bare.origin.startswith({str(ROOT)!r} + '/' + n), n\n"
            "print('ok')")
    out = py(code, tmp_path)
    assert out.stdout.strip() == "ok", out.stderr


def test_transformers_unharmed_when_the_checkout_is_on_sys_path() -> None:
    # `python -c` puts the working directory first on sys.path: our kernels/ folder is then
    # importable as a bare `kernels`, the name of the hub package transformers imports when
    # installed. Under that name it must hand over to that package, or else do nothing.
    out = py("import importlib.metadata, kernels\n"
             "try:\n"
             "    importlib.metadata.version('kernels')\n"
             f"    assert not kernels.__file__.startswith({str(ROOT / 'kernels')!r}), kernels.__file__\n"
             "except importlib.metadata.PackageNotFoundError:\n"
             "    assert not [n for n in dir(kernels) if not n.startswith('_')]\n"
             "from transformers import LlamaForCausalLM, LlamaConfig\n"
             "LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,"
             " num_hidden_layers=1, num_attention_heads=2))\n"
             "import meshserve.kernels.rmsnorm\nprint('ok')", ROOT)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_wheel_holds_the_namespace_configs_and_bundled_models(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, timeout=300,
                   capture_output=True)
    wheel = next(tmp_path.glob("meshserve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"meshserve", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                    + ".dist-info"}, tops
    for must in ("meshserve/__init__.py", "meshserve/parallel/layers/linear.py",
                 "meshserve/kernels/paged_attention.py", "meshserve/conf/config.yaml",
                 "meshserve/conf/model/llama-3-70b.yaml",
                 "meshserve/models/bundled/meshcoder/model.safetensors",
                 "meshserve/models/bundled/meshcoder-draft/tokenizer.json"):
        assert must in names, must
    assert not any(n.startswith("meshserve/tests/") for n in names)
