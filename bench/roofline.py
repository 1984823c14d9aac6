"""The machine's ceilings, measured in the same run, and the bytes/FLOPs a model step needs.

MBU of a decode step = bytes that must be read / step time / measured read bandwidth, where
the bytes are the weights on the rank (the input embedding table excluded unless it is
tied to the LM head: a decode step gathers one row of it) plus the KV cache read.
MFU of a prefill = its matmul and attention FLOPs / time / measured matmul FLOP/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from meshserve.models.arch import ModelArch


@dataclass(frozen=True)
class Roofline:
    """Measured ceilings of this machine at the current thread count."""

    read_bandwidth_gbs: float
    """GB/s (1e9 bytes) reading a large fp32 tensor (its sum)."""
    matmul_gflops: float
    """fp32 GFLOP/s of an N x N x N matmul."""
    read_bytes: int
    """Size of the tensor read."""
    matmul_size: int
    """N of the matmul."""
    threads: int
    """torch.get_num_threads() during the measurement."""

    def as_dict(self) -> dict[str, float]:
        """For the JSON result."""
        return asdict(self)


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: page faults, caches, lazy init
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_read_bandwidth(num_bytes: int = 2 << 30, repeats: int = 5) -> float:
    """GB/s reading `num_bytes` of fp32 (the best of `repeats` full reads)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    seconds = _best_time(lambda: x.sum(), repeats)
    return x.numel() * 4 / seconds / 1e9


def measure_matmul(n: int = 2048, repeats: int = 3) -> float:
    """fp32 GFLOP/s of an n x n by n x n matmul (the best of `repeats`)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    return 2 * n**3 / _best_time(lambda: a @ b, repeats) / 1e9


def measure(read_bytes: int = 2 << 30, matmul_size: int = 2048) -> Roofline:
    """Both ceilings, at torch's current thread count."""
    return Roofline(read_bandwidth_gbs=measure_read_bandwidth(read_bytes),
                    matmul_gflops=measure_matmul(matmul_size), read_bytes=read_bytes,
                    matmul_size=matmul_size, threads=torch.get_num_threads())


def weight_bytes_read(arch: ModelArch, itemsize: int) -> int:
    """Weight bytes a decode step reads: all parameters but an untied input embedding."""
    params = arch.num_params
    if not arch.tie_word_embeddings:
        params -= arch.vocab_size * arch.hidden_size
    return params * itemsize


def kv_bytes_per_token(arch: ModelArch, itemsize: int) -> int:
    """Bytes of K and V of one token over all layers."""
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * itemsize


def decode_bytes(arch: ModelArch, itemsize: int, context_tokens: float) -> float:
    """Bytes one decode step must read when its sequences hold `context_tokens` in total."""
    return weight_bytes_read(arch, itemsize) + kv_bytes_per_token(arch, itemsize) * context_tokens


def prefill_flops(arch: ModelArch, num_tokens: int) -> float:
    """FLOPs of a prefill of `num_tokens`: projections, MLP, causal attention, one LM-head row."""
    d, h = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * h, arch.num_key_value_heads * h
    per_token = 2 * (d * (q + 2 * kv) + q * d + 3 * d * arch.intermediate_size)
    attention = 2 * 2 * q * num_tokens * (num_tokens + 1) / 2  # QK^T and PV, causal half
    layers = arch.num_hidden_layers * (per_token * num_tokens + attention)
    return layers + 2 * d * arch.vocab_size


def utilization(work: float, seconds: float, rate: float) -> float:
    """work / seconds / rate (MBU with bytes and bytes/s, MFU with FLOPs and FLOP/s)."""
    return work / seconds / rate if seconds > 0 and rate > 0 else float("nan")
