"""Which model to serve and in what precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshserve.validation import require

MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")


CPU_WEIGHT_LAYOUTS = ("auto", "packed", "column", "row")
CPU_WEIGHT_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A model: a bundled one by name, or a local Hugging Face directory."""

    name: str = "meshcoder"
    """Short name (a bundled model, or a label for a config-only preset)."""

    path: str | None = None
    """Local Hugging Face model directory; null uses the bundled model called `name`."""

    dtype: str = "auto"
    """Compute dtype: auto (float32 on CPU, the checkpoint's dtype on GPU), float32, bfloat16, float16."""

    arch: dict[str, Any] | None = None
    """Config-only shape (Hugging Face config.json keys) for planning without weights."""

    cpu_weight_layout: str = "auto"
    """On CPU: packed stores every linear weight in panels for the C packed kernel (fp32,
    the C kernels built); column stores wide ones column-major (faster MKL GEMMs); row keeps
    every weight as loaded; auto is packed where it applies, else column. No effect on GPU."""

    cpu_weight_dtype: str = "auto"
    """On CPU, what the packed panels hold: auto and float32 keep the fp32 weights; bfloat16
    rounds each to bf16 (lossless for a bf16 checkpoint), half the bytes a decode step
    streams, widened back to fp32 in the C kernel as it computes. Needs packed panels
    (cpu_weight_layout auto or packed, an fp32 model, the C kernels). No effect on GPU."""

    @property
    def label(self) -> str:
        """The model as its user named it: the directory given, else its preset's name."""
        return self.path or self.name

    def __post_init__(self) -> None:
        require(self.cpu_weight_layout in CPU_WEIGHT_LAYOUTS, "model.cpu_weight_layout",
                self.cpu_weight_layout, f"one of {CPU_WEIGHT_LAYOUTS}")
        require(self.dtype in MODEL_DTYPES, "model.dtype", self.dtype, f"one of {MODEL_DTYPES}")
        require(self.cpu_weight_dtype in CPU_WEIGHT_DTYPES, "model.cpu_weight_dtype",
                self.cpu_weight_dtype, f"one of {CPU_WEIGHT_DTYPES}")
        require(self.cpu_weight_dtype != "bfloat16" or self.cpu_weight_layout in (
                    "auto", "packed"), "model.cpu_weight_dtype", self.cpu_weight_dtype,
                "auto or float32 with model.cpu_weight_layout="
                f"{self.cpu_weight_layout} (bf16 weights are packed panels)")
        require(bool(self.name), "model.name", self.name, "a non-empty name")
