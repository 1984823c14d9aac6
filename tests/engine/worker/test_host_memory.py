"""Host memory for CPU inference: glibc's malloc thresholds raised once per process, and
weights and KV caches moved onto (transparent) huge pages with their values, strides and
ties kept."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from meshserve.engine.worker.kv_cache import allocate_kv_cache
from meshserve.kernels.host_memory import (
    HUGE_PAGE_BYTES,
    huge_page_empty,
    to_huge_pages,
    tune_malloc,
)

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tune_malloc_applies_and_is_idempotent() -> None:
    assert tune_malloc() is True
    assert tune_malloc() is True


def _thp_eligible(address: int) -> bool | None:
    """THPeligible of the mapping holding `address` (None where smaps doesn't say)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def test_huge_page_empty_is_aligned_zeroed_and_outlives_its_buffer() -> None:
    t = huge_page_empty((3, 1000, 700), torch.float32)
    assert t.shape == (3, 1000, 700) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not t.any()  # anonymous memory comes zero-filled
    t.fill_(2.5)
    gc.collect()  # the tensor alone keeps the mapping alive
    assert float(t.sum()) == 2.5 * t.numel()
    if THP.exists() and "[never]" not in THP.read_text():
        assert _thp_eligible(t.data_ptr()) in (True, None)


def test_to_huge_pages_keeps_values_strides_and_ties() -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(3000, 256)
    head = torch.nn.Linear(256, 3000, bias=False)
    head.weight = emb.weight  # tied: one storage
    wide = torch.nn.Linear(256, 4096, bias=False)
    wide.weight.data = wide.weight.data.t().contiguous().t()  # column-major, as on CPU
    small = torch.nn.Linear(8, 8)
    model = torch.nn.ModuleDict(dict(emb=emb, head=head, wide=wide, small=small))
    before = {n: (p.clone(), p.stride()) for n, p in model.named_parameters()}
    small_ptr = small.weight.data_ptr()

    assert to_huge_pages(model) == 2  # the tied storage once, the wide weight; not `small`

    assert head.weight is emb.weight
    assert emb.weight.data_ptr() % HUGE_PAGE_BYTES == 0
    assert wide.weight.data_ptr() % HUGE_PAGE_BYTES == 0
    assert small.weight.data_ptr() == small_ptr
    for n, p in model.named_parameters():
        value, stride = before[n]
        assert p.stride() == stride and torch.equal(p, value), n
    assert isinstance(wide.weight, torch.nn.Parameter)


def test_cpu_kv_cache_on_huge_pages_is_zeroed_per_layer() -> None:
    cache = allocate_kv_cache(2, 64, 16, 4, 64, torch.float32, torch.device("cpu"))
    ptrs = set()
    for k, v in cache:
        for t in (k, v):
            assert t.shape == (64, 16, 4, 64) and not t.any()
            assert t.data_ptr() % HUGE_PAGE_BYTES == 0
            ptrs.add(t.data_ptr())
    assert len(ptrs) == 4
    plain = allocate_kv_cache(1, 64, 16, 4, 64, torch.float32, torch.device("cpu"),
                              huge_pages=False)
    assert not plain[0][0].any()
