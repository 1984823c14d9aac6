"""A cluster description: nodes, devices, interconnects and their speeds."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.validation import require

DEVICE_TYPES = ("cuda", "cpu")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """What the planner and cost model know about the machines."""

    name: str = "local-cpu"
    """Preset name."""
    device_type: str = "cpu"
    """cuda or cpu."""
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
    peak_tflops_bf16: float = 0.18
    """Dense bf16 matmul rate per device, TFLOP/s."""
    peak_tflops_fp32: float = 0.084
    """Dense fp32 matmul rate per device, TFLOP/s."""
    intra_node_bandwidth_gbs: float = 2.2
    """Per-device bandwidth inside an NVLink domain (NVLink, or shared memory), GB/s."""
    intra_node_latency_us: float = 300.0
    """Per-message latency inside a node, µs."""
    inter_node_bandwidth_gbs: float = 2.2
    """Per-device bandwidth between nodes (InfiniBand / RoCE), GB/s."""
    inter_node_latency_us: float = 300.0
    """Per-message latency between nodes, µs."""

    def __post_init__(self) -> None:
        require(self.device_type in DEVICE_TYPES, "cluster.device_type", self.device_type,
                f"one of {DEVICE_TYPES}")
        for n in ("num_nodes", "devices_per_node", "nvlink_domain_size"):
            require(getattr(self, n) >= 1, f"cluster.{n}", getattr(self, n), "an int >= 1")
        require(self.devices_per_node % self.nvlink_domain_size == 0, "cluster.nvlink_domain_size",
                self.nvlink_domain_size, f"a divisor of devices_per_node={self.devices_per_node}")
        for n in ("device_memory_gb", "memory_bandwidth_gbs", "peak_tflops_bf16",
                  "peak_tflops_fp32", "intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs"):
            require(getattr(self, n) > 0, f"cluster.{n}", getattr(self, n), "a number > 0")

    @property
    def num_devices(self) -> int:
        """Devices in the whole cluster."""
        return self.num_nodes * self.devices_per_node
