"""The machine's ceilings, measured in the same run, and the bytes/FLOPs a model step needs.

MBU of a decode step = bytes that must be read / step time / measured read bandwidth, where
the bytes are the weights on the rank (the input embedding table excluded unless it is
tied to the LM head: a decode step gathers one row of it) plus the KV cache read.
MFU of a prefill = its matmul and attention FLOPs / time / measured matmul FLOP/s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.calibration import best_time
from meshserve.parallel.planner.model_shape import ModelShape

CPU = torch.device("cpu")


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


def measure_read_bandwidth(num_bytes: int = 2 << 30, repeats: int = 5) -> float:
    """GB/s reading `num_bytes` of fp32 (the best of `repeats` full reads)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    seconds = best_time(lambda: x.sum(), repeats, CPU)
    return x.numel() * 4 / seconds / 1e9


def measure_matmul(n: int = 2048, repeats: int = 3) -> float:
    """fp32 GFLOP/s of an n x n by n x n matmul (the best of `repeats`)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    return 2 * n**3 / best_time(lambda: a @ b, repeats, CPU) / 1e9


def measure(read_bytes: int = 2 << 30, matmul_size: int = 2048) -> Roofline:
    """Both ceilings, at torch's current thread count."""
    return Roofline(read_bandwidth_gbs=measure_read_bandwidth(read_bytes),
                    matmul_gflops=measure_matmul(matmul_size), read_bytes=read_bytes,
                    matmul_size=matmul_size, threads=torch.get_num_threads())


def _shape(arch: ModelArch, itemsize: int) -> ModelShape:
    """The cost model's shape of `arch` at `itemsize` bytes an element: the bench and the
    planner count bytes and FLOPs with the same model."""
    return ModelShape.from_arch(arch, {4: "float32", 2: "bfloat16"}[itemsize])


def weight_bytes_read(arch: ModelArch, itemsize: int) -> int:
    """Weight bytes a decode step reads: all parameters but an untied input embedding."""
    return _shape(arch, itemsize).decode_weight_bytes


def kv_bytes_per_token(arch: ModelArch, itemsize: int) -> int:
    """Bytes of K and V of one token over all layers."""
    shape = _shape(arch, itemsize)
    return shape.num_layers * shape.kv_bytes_per_token()


def decode_bytes(arch: ModelArch, itemsize: int, context_tokens: float) -> float:
    """Bytes one decode step must read when its sequences hold `context_tokens` in total."""
    return weight_bytes_read(arch, itemsize) + kv_bytes_per_token(arch, itemsize) * context_tokens


def prefill_flops(arch: ModelArch, num_tokens: int) -> float:
    """FLOPs of a prefill of `num_tokens`: projections, MLP, causal attention, one LM-head row."""
    return _shape(arch, 4).prefill_flops(num_tokens)


def utilization(work: float, seconds: float, rate: float) -> float:
    """work / seconds / rate (MBU with bytes and bytes/s, MFU with FLOPs and FLOP/s)."""
    return work / seconds / rate if seconds > 0 and rate > 0 else float("nan")
