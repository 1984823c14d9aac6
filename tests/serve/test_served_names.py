"""The served model's names: by default the model as given (its directory, or a preset's
name), or `serve.served_model_name` as one name or a list of aliases; `meshserve serve DIR`
takes the directory as its first argument, as `vllm serve DIR` does."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from meshserve.launch.cli import model_argument
from meshserve.launch.cli_config import ConfigError, load_config
from meshserve.models.bundled import BUNDLED_DIR
from meshserve.serve.serve_config import ServeConfig

from .conftest import ENGINE_OVERRIDES


def test_a_first_argument_names_a_directory_or_a_preset(tmp_path: Path) -> None:
    assert model_argument([str(tmp_path), "a=1"]) == [f"model.path='{tmp_path}'",
                                                      f"model.name='{tmp_path.name}'", "a=1"]
    assert model_argument(["llama-3-8b"]) == ["model=llama-3-8b"]
    assert model_argument(["engine.block_size=8"]) == ["engine.block_size=8"]
    with pytest.raises(ConfigError, match=r"^nope: neither a model directory nor a model preset"):
        model_argument(["nope"])


def test_served_names_default_to_the_model_as_given(tmp_path: Path) -> None:
    assert load_config([f"model.path={tmp_path}"]).model.label == str(tmp_path)
    assert load_config(["model=llama-3-8b"]).model.label == "llama-3-8b"
    assert ServeConfig().model_names("m") == ["m"]
    assert ServeConfig(served_model_name="a").model_names("m") == ["a"]
    assert ServeConfig(served_model_name=["a", "b"]).model_names("m") == ["a", "b"]
    with pytest.raises(ValueError, match=r"^serve.served_model_name=\[\]"):
        ServeConfig(served_model_name=[])


def test_serve_dir_answers_to_the_directory_and_to_aliases(start_server, tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    shutil.copytree(BUNDLED_DIR / "meshcoder", model_dir)
    srv = start_server(ENGINE_OVERRIDES, model=[str(model_dir)])
    ids = [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]]
    assert ids == [str(model_dir)]
    body = {"model": str(model_dir), "prompt": "def f(x):", "max_tokens": 4}
    resp = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == str(model_dir)
    srv.stop()
    aliases = start_server([*ENGINE_OVERRIDES, "serve.served_model_name=[coder,coder-v1]"],
                           model=[str(model_dir)])
    ids = [m["id"] for m in httpx.get(f"{aliases.url}/v1/models").json()["data"]]
    assert ids == ["coder", "coder-v1"]
    for name in ids:
        resp = httpx.post(f"{aliases.url}/v1/completions", json={**body, "model": name},
                          timeout=60)
        assert resp.status_code == 200 and resp.json()["model"] == name, resp.text
    resp = httpx.post(f"{aliases.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 404
    assert "allowed: 'coder', 'coder-v1'" in resp.json()["error"]["message"]


def test_plan_names_the_model_by_its_directory(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from meshserve.launch import plan

    model_dir = tmp_path / "my-model"
    shutil.copytree(BUNDLED_DIR / "meshcoder", model_dir)
    assert plan.run([f"model.path={model_dir}", "plan.top=1"]) == 0
    assert capsys.readouterr().out.startswith(f"model {model_dir} (")
