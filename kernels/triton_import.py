"""Triton, or stand-ins when it is not installed, so kernel modules import on any machine.

Only the dispatcher's Triton path imports the kernel modules; without Triton their
`@triton.jit` functions become stand-ins that raise when launched. On a CPU, Triton
runs only in its interpreter, which reads TRITON_INTERPRET=1 when Triton is first
imported: set it before this module is imported.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the PyTorch references serve every call
    HAS_TRITON = False

    class _Unavailable:
        def __init__(self, fn: Any) -> None:
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"{self.__name__}: triton is not installed; the PyTorch "
                               "reference is the path without it")

    class _TritonStub:
        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            return _Unavailable(fn) if fn is not None else _Unavailable

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    class _LanguageStub:
        constexpr = Any

    triton = _TritonStub()  # type: ignore[assignment]
    tl = _LanguageStub()  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "triton", "tl"]


def dot_config(dtype: Any, device: Any) -> tuple[bool, str]:
    """(upcast operands to fp32, tl.dot input_precision) for inputs of `dtype` on `device`.

    fp32 dots ask for IEEE precision (TF32 would miss the reference's tolerance). The
    interpreter (any CPU launch) computes bf16 tl.dot wrongly (Triton 3.9, measured), so
    there bf16 operands are upcast; on a GPU they stay bf16 for the tensor cores.
    """
    import torch

    upcast = device.type == "cpu" and dtype == torch.bfloat16
    return upcast, "ieee" if upcast or dtype == torch.float32 else "tf32"
