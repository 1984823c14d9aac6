"""Describe the machines we run on: GPUs from torch.cuda, links from `nvidia-smi topo -m`,
nodes from Slurm. The parsing is pure (tested on canned text); `detect_cluster` gathers.

What detection can't see (InfiniBand speed, the datasheet peaks) comes from a table of
known GPUs; `meshserve calibrate` replaces guesses with measurements.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from meshserve.parallel.comm.discovery import expand_nodelist
from meshserve.parallel.planner.cluster import ClusterConfig

NVLINK_GBS_PER_LINK = 25.0
"""NVLink 3 and 4: 25 GB/s per direction per link (H100 SXM: 18 links = 450 GB/s)."""
PCIE_GBS = 25.0
"""What a PCIe Gen4 x16 path between two GPUs reaches in practice (32 GB/s nominal)."""
IB_GBS_PER_GPU = 50.0
"""One 400 Gb/s InfiniBand NIC per GPU (DGX H100/H200); not detected, assumed."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Datasheet figures of a GPU model (dense tensor-core rates)."""

    memory_gb: float
    """HBM / GDDR, GB."""
    bandwidth_gbs: float
    """Memory bandwidth, GB/s."""
    tflops_bf16: float
    """Dense bf16 TFLOP/s."""
    tflops_fp32: float
    """fp32 TFLOP/s (no tensor cores)."""


# Matched in order against torch.cuda.get_device_name(); NVIDIA datasheets.
GPU_SPECS: tuple[tuple[str, GpuSpec], ...] = (
    ("H200", GpuSpec(memory_gb=141, bandwidth_gbs=4800, tflops_bf16=989, tflops_fp32=67)),
    ("H100 PCIe", GpuSpec(memory_gb=80, bandwidth_gbs=2000, tflops_bf16=756, tflops_fp32=51)),
    ("H100", GpuSpec(memory_gb=80, bandwidth_gbs=3350, tflops_bf16=989, tflops_fp32=67)),
    ("A100-SXM4-80GB", GpuSpec(memory_gb=80, bandwidth_gbs=2039, tflops_bf16=312,
                               tflops_fp32=19.5)),
    ("A100", GpuSpec(memory_gb=40, bandwidth_gbs=1555, tflops_bf16=312, tflops_fp32=19.5)),
    ("L40S", GpuSpec(memory_gb=48, bandwidth_gbs=864, tflops_bf16=362, tflops_fp32=91.6)),
)


def gpu_spec(name: str) -> GpuSpec | None:
    """The datasheet entry whose key occurs in the device name, or None."""
    return next((spec for key, spec in GPU_SPECS if key.lower() in name.lower()), None)


def parse_topo_matrix(text: str) -> list[list[str]]:
    """The GPU x GPU link matrix of `nvidia-smi topo -m` ('X', 'NV18', 'SYS', 'PIX', ...)."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    header = next((ln.split() for ln in lines if ln.split()[:1] == ["GPU0"]), None)
    if header is None:
        return []
    num_gpus = sum(1 for col in header if re.fullmatch(r"GPU\d+", col))
    rows = [ln.split() for ln in lines if re.match(r"GPU\d+\s", ln)]
    matrix = [row[1:1 + num_gpus] for row in rows[:num_gpus]]
    assert all(len(r) == num_gpus for r in matrix), matrix
    return matrix


def nvlink_links(entry: str) -> int:
    """NVLinks of one matrix entry: 'NV18' -> 18, anything else 0."""
    m = re.fullmatch(r"NV(\d+)", entry)
    return int(m.group(1)) if m else 0


def nvlink_domains(matrix: list[list[str]]) -> list[list[int]]:
    """GPUs grouped by NVLink connectivity (connected components), in index order."""
    n, seen, groups = len(matrix), set(), []
    for start in range(n):
        if start in seen:
            continue
        group, todo = [], [start]
        seen.add(start)
        while todo:
            i = todo.pop()
            group.append(i)
            for j in range(n):
                if j not in seen and nvlink_links(matrix[i][j]):
                    seen.add(j)
                    todo.append(j)
        groups.append(sorted(group))
    return groups


def nvlink_domain_size(matrix: list[list[str]]) -> int:
    """The domain size the planner may rely on: the smallest NVLink group whose size divides
    the GPU count, and whose members are consecutive (1 without NVLink)."""
    groups = nvlink_domains(matrix)
    if not groups:
        return 1
    size = min(len(g) for g in groups)
    aligned = all(g == list(range(g[0], g[0] + len(g))) for g in groups)
    return size if aligned and len(matrix) % size == 0 else 1


def nvlink_bandwidth_gbs(matrix: list[list[str]]) -> float | None:
    """Per-direction bandwidth of the slowest NVLink pair, or None without NVLink."""
    links = [nvlink_links(e) for row in matrix for e in row if nvlink_links(e)]
    return min(links) * NVLINK_GBS_PER_LINK if links else None


def slurm_num_nodes(env: Mapping[str, str]) -> int | None:
    """Nodes of the Slurm job, or None outside Slurm."""
    for key in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if env.get(key, "").isdigit():
            return int(env[key])
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    return len(expand_nodelist(nodelist)) if nodelist else None


def cluster_from_gpus(*, names: list[str], memory_bytes: list[int], topo_text: str,
                      env: Mapping[str, str]) -> ClusterConfig:
    """A ClusterConfig for this node's GPUs, replicated over the Slurm job's nodes."""
    assert names, "no GPUs to describe"
    spec = gpu_spec(names[0]) or GpuSpec(memory_gb=min(memory_bytes) / 1e9,
                                         bandwidth_gbs=1000, tflops_bf16=100, tflops_fp32=20)
    matrix = parse_topo_matrix(topo_text)
    domain = nvlink_domain_size(matrix) if len(matrix) == len(names) else 1
    nvlink = nvlink_bandwidth_gbs(matrix) if domain > 1 else None
    nodes = slurm_num_nodes(env) or 1
    return ClusterConfig(
        name=f"detected-{len(names)}x{re.sub(r'[^A-Za-z0-9]+', '-', names[0]).strip('-')}",
        device_type="cuda", device_name=names[0], source="detected", num_nodes=nodes,
        devices_per_node=len(names), nvlink_domain_size=domain,
        device_memory_gb=min(memory_bytes) / 1e9, memory_bandwidth_gbs=spec.bandwidth_gbs,
        peak_tflops_bf16=spec.tflops_bf16, peak_tflops_fp32=spec.tflops_fp32,
        intra_node_bandwidth_gbs=nvlink or PCIE_GBS,
        intra_node_latency_us=1.5 if nvlink else 5.0,
        inter_node_bandwidth_gbs=IB_GBS_PER_GPU if nodes > 1 and domain > 1 else PCIE_GBS,
        inter_node_latency_us=5.0)


def _nvidia_smi_topo() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        return subprocess.run([exe, "topo", "-m"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def detect_cluster(env: Mapping[str, str] | None = None) -> ClusterConfig | None:
    """This machine's GPUs as a ClusterConfig, or None without CUDA (use a CPU preset)."""
    import torch

    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(count)]
    return cluster_from_gpus(names=[p.name for p in props],
                             memory_bytes=[p.total_memory for p in props],
                             topo_text=_nvidia_smi_topo(), env=os.environ if env is None else env)
