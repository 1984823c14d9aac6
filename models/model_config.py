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
    """Model dtype: auto (the checkpoint's, but float32 on CPU unless the checkpoint is
    bf16), float32, bfloat16, float16. On CPU a bfloat16 model holds bf16 weights
    (cpu_weight_dtype) and computes its activations in fp32, or bf16 where a kernel is
    faster so (batched linears in oneDNN); float32 keeps fp32 weights and activations."""

    arch: dict[str, Any] | None = None
    """Config-only shape (Hugging Face config.json keys) for planning without weights."""

    cpu_weight_layout: str = "auto"
    """On CPU: packed stores every linear weight in panels for the C packed kernel (fp32,
    the C kernels built); column stores wide ones column-major (faster MKL GEMMs); row keeps
    every weight as loaded; auto is packed where it applies, else column. No effect on GPU."""

    cpu_weight_dtype: str = "auto"
    """On CPU, what the packed panels hold: auto is bfloat16 for a bf16 model (dtype) with
    packed panels and the C kernels, else float32; bfloat16 rounds each weight to bf16
    (lossless for a bf16 checkpoint), half the bytes a decode step streams, widened to fp32
    in the C kernels as they compute (where the CPU has AVX512_BF16 or AMX, batches of 4
    rows or more run in oneDNN from its own prepacked copy); float32 keeps fp32 weights.
    Needs packed panels (cpu_weight_layout auto or packed, the C kernels). No effect on
    GPU."""

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
