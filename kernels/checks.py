"""Argument checks shared by the Triton launchers: clear ValueErrors before any launch."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_dim(name: str, t: torch.Tensor, ndim: int) -> None:
    """`t` has `ndim` dimensions."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions; got shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """`t` has exactly `shape`."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}; got {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """`t`'s dtype is one of `allowed`."""
    if t.dtype not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}; allowed are {list(allowed)}")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """`t` has `ref`'s dtype."""
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; "
                         "they must match")


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    """The last dimension is dense (stride 1), as the kernels' vector loads assume."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension; got strides "
                         f"{t.stride()}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """`t` is contiguous (a cache or a table the kernel indexes by computed offsets)."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {t.stride()} for shape "
                         f"{tuple(t.shape)}")


def check_same_device(*named: tuple[str, torch.Tensor]) -> None:
    """Every tensor sits on the first one's device."""
    dev = named[0][1].device
    for name, t in named[1:]:
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but {named[0][0]} is on {dev}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_kv_heads, head_dim) of a matching contiguous K/V pair."""
    check_dim("k_cache", k_cache, 4)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)
    check_same_dtype("v_cache", v_cache, "k_cache", k_cache)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size & (block_size - 1):
        raise ValueError(f"cache block_size must be a power of two; got {block_size}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads}")
    return num_heads // num_kv_heads


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 << max(0, n - 1).bit_length()
