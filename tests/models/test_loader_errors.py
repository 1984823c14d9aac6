"""A broken model directory fails with an error naming the file and the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshserve.models.arch import CheckpointError
from meshserve.models.loader import load_model


@pytest.fixture
def ckpt(make_checkpoint, tmp_path: Path) -> Path:
    """A private copy of a good checkpoint, to break."""
    dst = tmp_path / "model"
    shutil.copytree(make_checkpoint("llama"), dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, fn) -> None:  # noqa: ANN001
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_good_checkpoint_loads(ckpt: Path) -> None:
    assert load_model(ckpt, progress=False).arch.num_hidden_layers == 2


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing model directory"):
        load_model(tmp_path / "nope")


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing file"):
        load_model(ckpt)


def test_config_not_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_model(ckpt)


def test_unknown_architecture(ckpt: Path) -> None:
    _edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"config\.json: architecture 'GPT2LMHeadModel' "
                                              r"is not supported"):
        load_model(ckpt)


def test_unsupported_rope_type(ckpt: Path) -> None:
    _edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(CheckpointError, match=r"rope_scaling\.rope_type='yarn'"):
        load_model(ckpt)


def test_missing_weights_file(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing file: no model\.safetensors"):
        load_model(ckpt)


def test_missing_tensor(ckpt: Path) -> None:
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\).*layers\.1\.self_attn"
                                              r"\.qkv_proj\.weight \[k\]"):
        load_model(ckpt)


def test_misshaped_tensor(ckpt: Path) -> None:
    def cut(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :7].contiguous()

    _edit_tensors(ckpt, cut)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp"
                                              r"\.down_proj\.weight' has shape \[64, 7\], "
                                              r"expected \[64, 112\]"):
        load_model(ckpt)


def test_unsupported_dtype(ckpt: Path) -> None:
    def to_int8(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int8)

    _edit_tensors(ckpt, to_int8)
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype I8, unsupported"):
        load_model(ckpt)


def test_unexpected_tensor(ckpt: Path) -> None:
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.extra"):
        load_model(ckpt)


def test_sharded_checkpoint_with_index(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, ckpt / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, fname))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(ckpt, progress=False)
    torch.testing.assert_close(model.model.norm.weight, tensors["model.norm.weight"])
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: missing file "
                                              r"\(listed in model\.safetensors\.index\.json\)"):
        load_model(ckpt)


def test_pipeline_stage_reads_only_its_layers(ckpt: Path) -> None:
    first = load_model(ckpt, layer_range=(0, 1), progress=False)
    last = load_model(ckpt, layer_range=(1, 2), progress=False)
    assert list(first.model.layers) == ["0"] and list(last.model.layers) == ["1"]
    assert first.lm_head is None and last.model.embed_tokens is None
