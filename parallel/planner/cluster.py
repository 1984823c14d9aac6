"""A cluster description: nodes, devices, interconnects and their speeds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshserve.validation import require

DEVICE_TYPES = ("cuda", "cpu")
SOURCES = ("datasheet", "calibrated", "detected")
DTYPE_PEAKS = {"bfloat16": "peak_tflops_bf16", "float16": "peak_tflops_bf16",
               "float32": "peak_tflops_fp32"}


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """What the planner and cost model know about the machines."""

    name: str = "local-cpu"
    """Preset name."""
    device_type: str = "cpu"
    """cuda or cpu."""
    device_name: str = ""
    """What each device is (for display), e.g. 'H100 SXM 80GB'."""
    source: str = "datasheet"
    """Where the figures come from: datasheet, calibrated (measured here) or detected."""
    num_nodes: int = 1
    """Nodes."""
    devices_per_node: int = 2
    """Devices (GPUs, or CPU ranks) per node."""
    nvlink_domain_size: int = 2
    """Devices that share the fast intra-node fabric (1 on PCIe-only machines)."""
    device_memory_gb: float = 24.0
    """Memory per device, GB."""
    memory_bandwidth_gbs: float = 27.0
    """Per-device memory bandwidth (HBM, or DRAM per CPU rank), GB/s."""
    node_memory_bandwidth_gbs: float | None = None
    """Memory bandwidth all devices of a node share (CPU ranks on one socket); null: none."""
    peak_tflops_bf16: float = 0.18
    """Dense bf16 (and fp16) matmul rate per device, TFLOP/s."""
    peak_tflops_fp32: float = 0.084
    """Dense fp32 matmul rate per device, TFLOP/s."""
    intra_node_bandwidth_gbs: float = 2.2
    """Per-device, per-direction bandwidth inside an NVLink domain (NVLink, or shared memory), GB/s."""
    intra_node_latency_us: float = 300.0
    """Latency of one message (one ring step) inside a node, µs."""
    inter_node_bandwidth_gbs: float = 2.2
    """Per-device bandwidth between nodes and between NVLink domains (InfiniBand, PCIe), GB/s."""
    inter_node_latency_us: float = 300.0
    """Latency of one message (one ring step) between nodes or domains, µs."""
    layer_overhead_us: float = 0.0
    """Fixed time per decoder layer per forward besides the roofline (launches, Python), µs."""
    step_overhead_us: float = 0.0
    """Fixed time per forward outside the layers (input prep, sampling, Python), µs."""
    step_seq_overhead_us: float = 0.0
    """Time per sequence per forward outside the layers (its sampling and output, the
    scheduler's and input preparation's work for it), µs."""
    seq_overhead_us: float = 0.0
    """Time per sequence per decoder layer besides the roofline (per-sequence attention
    bookkeeping), µs."""
    kv_read_fraction: float = 1.0
    """Share of memory_bandwidth at which decode attention reads the paged KV cache
    (`meshserve calibrate` measures it: on this project's CPUs the C kernel reads the blocks
    in place at about half a GEMV's rate, the PyTorch reference's gather and copy at 8%;
    1 where a kernel reads at full speed)."""
    kv_row_overhead_ns: float = 0.0
    """Time per cached token per decoder layer that decode attention spends besides reading
    its bytes (scores, softmax, finding scattered blocks), ns. `meshserve calibrate` fits it
    with kv_read_fraction over four head shapes (rows of 1-8 KiB): on this project's CPUs
    the C kernel takes 60-90 ns a row beside the bytes, so a small model's 1 KiB rows read
    at about half the rate its 8 KiB rows do. 0 where the kernel hides it behind the bytes
    (GPUs)."""
    attention_efficiency: float = 1.0
    """Share of the peak rate at which attention computes QK^T and PV (prefill chunks): on
    this project's CPUs PyTorch's SDPA reaches about half of it (`meshserve calibrate`
    measures it there); 1 where the kernels run near peak."""
    matmul_half_rows: float = 0.0
    """Rows (tokens) at which a weight matmul reaches half the peak rate: a matmul of M rows
    runs at peak x M / (M + this). CPU BLAS runs small-M (decode) matmuls far below peak;
    0 means peak from one row (GPUs, where such steps are memory-bound anyway)."""
    matmul_efficiency: list[float] = field(default_factory=list)
    """Measured share of the peak rate a weight matmul of 1, 2, 4, ... rows reaches (weights
    not in cache; `meshserve calibrate`), interpolated in log rows and held beyond the last;
    empty: the matmul_half_rows curve. CPU BLAS is far from that curve's shape: its time
    barely grows from 4 to 8 rows, say, which decides whether pipeline micro-batches pay."""

    def __post_init__(self) -> None:
        require(self.device_type in DEVICE_TYPES, "cluster.device_type", self.device_type,
                f"one of {DEVICE_TYPES}")
        require(self.source in SOURCES, "cluster.source", self.source, f"one of {SOURCES}")
        for n in ("num_nodes", "devices_per_node", "nvlink_domain_size"):
            require(getattr(self, n) >= 1, f"cluster.{n}", getattr(self, n), "an int >= 1")
        require(self.devices_per_node % self.nvlink_domain_size == 0, "cluster.nvlink_domain_size",
                self.nvlink_domain_size, f"a divisor of devices_per_node={self.devices_per_node}")
        for n in ("device_memory_gb", "memory_bandwidth_gbs", "peak_tflops_bf16",
                  "peak_tflops_fp32", "intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs"):
            require(getattr(self, n) > 0, f"cluster.{n}", getattr(self, n), "a number > 0")
        for n in ("intra_node_latency_us", "inter_node_latency_us", "layer_overhead_us",
                  "step_overhead_us", "step_seq_overhead_us", "seq_overhead_us",
                  "kv_row_overhead_ns", "matmul_half_rows"):
            require(getattr(self, n) >= 0, f"cluster.{n}", getattr(self, n), "a number >= 0")
        require(all(0 < e <= 1 for e in self.matmul_efficiency), "cluster.matmul_efficiency",
                self.matmul_efficiency, "shares of the peak in (0, 1]")
        for n in ("kv_read_fraction", "attention_efficiency"):
            require(0 < getattr(self, n) <= 1, f"cluster.{n}", getattr(self, n),
                    "a number in (0, 1]")
        require(self.node_memory_bandwidth_gbs is None or self.node_memory_bandwidth_gbs > 0,
                "cluster.node_memory_bandwidth_gbs", self.node_memory_bandwidth_gbs,
                "null or a number > 0")

    @property
    def num_devices(self) -> int:
        """Devices in the whole cluster."""
        return self.num_nodes * self.devices_per_node

    def peak_flops(self, dtype: str) -> float:
        """Dense matmul FLOP/s per device for a compute dtype (float32, bfloat16, float16)."""
        require(dtype in DTYPE_PEAKS, "dtype", dtype, f"one of {tuple(DTYPE_PEAKS)}")
        return getattr(self, DTYPE_PEAKS[dtype]) * 1e12

    def matmul_flops(self, dtype: str, rows: float) -> float:
        """FLOP/s of a weight matmul over `rows` tokens (see matmul_efficiency and
        matmul_half_rows)."""
        peak = self.peak_flops(dtype)
        table = self.matmul_efficiency
        if table and rows > 0:
            x = min(max(math.log2(rows), 0.0), len(table) - 1.0)
            i = min(int(x), len(table) - 2) if len(table) > 1 else 0
            frac = x - i
            share = table[i] if len(table) == 1 else table[i] + frac * (table[i + 1] - table[i])
            return peak * share
        if self.matmul_half_rows <= 0 or rows <= 0:
            return peak
        return peak * rows / (rows + self.matmul_half_rows)

    def memory_bandwidth(self, active_devices_per_node: int = 1) -> float:
        """Bytes/s one device reads while `active_devices_per_node` devices of its node run."""
        bw = self.memory_bandwidth_gbs
        if self.node_memory_bandwidth_gbs is not None:
            bw = min(bw, self.node_memory_bandwidth_gbs / max(1, active_devices_per_node))
        return bw * 1e9
