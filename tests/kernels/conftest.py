"""Kernel tests: Triton kernels run in Triton's interpreter on CPU, against their references.

TRITON_INTERPRET is read when Triton is first imported (its own tl helpers are decorated
then) and when each kernel module is imported; it is set here, before either happens.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
"""Without CUDA the kernels run in the interpreter on CPU tensors; with it, the gpu-marked
tests compile them for the device and the interpreter tests are skipped."""
if INTERPRET:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed: the kernel tests need it")


@pytest.fixture(autouse=True)
def _kernel_mode_read_afresh() -> Iterator[None]:
    """MESHSERVE_KERNELS is read once per process; tests that set it start and end clean."""
    from meshserve.kernels import dispatch

    dispatch.kernel_mode.cache_clear()
    yield
    dispatch.kernel_mode.cache_clear()


@pytest.fixture(autouse=True)
def _interpreter_or_gpu(request: pytest.FixtureRequest) -> None:
    if not INTERPRET and request.node.get_closest_marker("gpu") is None:
        pytest.skip("CUDA is present: Triton compiles for it; the gpu tests cover the kernels")

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}
"""Absolute tolerance per dtype against a float32 reference on the same (rounded) inputs.
bf16 is loose: the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest."""


@dataclass
class PagedCache:
    """A random paged K/V cache and block tables whose blocks are shuffled and disjoint."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor


def make_paged_cache(lengths: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype, seed: int = 0, spare_blocks: int = 3) -> PagedCache:
    """A cache holding one sequence per length; tables padded with 0 to the widest."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(max(need), 1)
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n] + [0] * (width - n))
        used += n
    return PagedCache(k, v, torch.tensor(tables, dtype=torch.long))


@pytest.fixture
def paged_cache() -> Callable[..., PagedCache]:
    """paged_cache(lengths, num_kv_heads, head_dim, block_size, dtype) -> PagedCache."""
    return make_paged_cache


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """out (any dtype) within the dtype's tolerance of the float32 reference."""
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.fixture
def close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    """close(out, ref, dtype): assert within the dtype's tolerance."""
    return assert_close
