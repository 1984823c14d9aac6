"""Where a model's files are: a local directory, or one bundled with meshserve."""

from __future__ import annotations

from pathlib import Path

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
