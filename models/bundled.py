"""Where a model's files are: a local directory, or one bundled with meshserve."""

from __future__ import annotations

from pathlib import Path

from meshserve.models.arch import ModelArch
from meshserve.models.model_config import ModelConfig

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"


def bundled_models() -> list[str]:
    """Names of the models shipped in models/bundled/."""
    if not BUNDLED_DIR.is_dir():
        return []
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_dir(name: str, path: str | None) -> Path:
    """The directory holding config.json and the weights, with errors naming the field."""
    if path:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise ValueError(f"model.path={path!r}: no such directory; allowed is a local "
                             "Hugging Face model directory")
        return p
    if (BUNDLED_DIR / name / "config.json").is_file():
        return BUNDLED_DIR / name
    raise ValueError(f"model.name={name!r} has no bundled weights and model.path is not set; "
                     f"allowed: a bundled model ({', '.join(bundled_models()) or 'none'}) or "
                     "model.path=/dir/of/a/hf/model")


def resolve_draft_dir(draft_model: str | None, model_name: str, model_path: str | None) -> Path:
    """The draft model's directory for speculative decoding: `draft_model` a bundled name or
    a local Hugging Face directory; None: the target's bundled draft (`<name>-draft`)."""
    if draft_model is None:
        if not model_path and (BUNDLED_DIR / f"{model_name}-draft" / "config.json").is_file():
            return BUNDLED_DIR / f"{model_name}-draft"
        target = model_path or model_name
        raise ValueError(f"speculative.draft_model=null: the target {target!r} has no bundled "
                         "draft; allowed: a bundled model "
                         f"({', '.join(bundled_models()) or 'none'}) or a local Hugging Face "
                         "directory")
    if (BUNDLED_DIR / draft_model / "config.json").is_file():
        return BUNDLED_DIR / draft_model
    p = Path(draft_model).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return p
    raise ValueError(f"speculative.draft_model={draft_model!r}: neither a bundled model nor a "
                     "directory with a config.json; allowed: a bundled model "
                     f"({', '.join(bundled_models()) or 'none'}) or a local Hugging Face "
                     "directory")


def resolve_arch(model: ModelConfig) -> ModelArch:
    """The model's shape: the preset's `arch` dict, else config.json of its directory."""
    if model.arch:
        return ModelArch.from_hf_dict(dict(model.arch), source=f"model.arch of {model.name}")
    return ModelArch.from_dir(resolve_model_dir(model.name, model.path))
