"""Topology detection: nvidia-smi topo -m parsing, Slurm node lists, GPU specs."""

from __future__ import annotations

from meshserve.parallel.planner.topology import (
    cluster_from_gpus,
    expand_nodelist,
    gpu_spec,
    nvlink_bandwidth_gbs,
    nvlink_domain_size,
    nvlink_domains,
    parse_topo_matrix,
    slurm_num_nodes,
)


def topo(links: list[list[str]], nics: int = 2, ansi: bool = False) -> str:
    """A `nvidia-smi topo -m` printout with these GPU links (the shape driver 550 prints)."""
    n = len(links)
    cols = [f"GPU{i}" for i in range(n)] + [f"NIC{i}" for i in range(nics)]
    head = "\t" + "\t".join(cols) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"
    if ansi:
        head = "\x1b[4m" + head + "\x1b[0m"
    rows = [f"GPU{i}\t" + "\t".join(" X " if i == j else links[i][j] for j in range(n))
            + "\t" + "\t".join(["PXB"] * nics) + f"\t{0 if i < n // 2 else 56}-55\t0\t\tN/A"
            for i in range(n)]
    nic_rows = [f"NIC{k}\t" + "\t".join(["PXB"] * n + ["X" if k == m else "SYS"
                                                        for m in range(nics)])
                for k in range(nics)]
    legend = ["", "Legend:", "", "  X    = Self",
              "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes",
              "  NV#  = Connection traversing a bonded set of # NVLinks", "",
              "NIC Legend:", "", "  NIC0: mlx5_0"]
    return "\n".join([head, *rows, *nic_rows, *legend]) + "\n"


def full(n: int, link: str) -> list[list[str]]:
    return [[link] * n for _ in range(n)]


DGX_H100 = topo(full(8, "NV18"), ansi=True)
L40S_PCIE = topo([["NODE" if (i < 4) == (j < 4) else "SYS" for j in range(8)] for i in range(8)])
BRIDGED_PAIRS = topo([["NV4" if i // 2 == j // 2 else "PHB" for j in range(4)] for i in range(4)],
                     nics=0)


def test_dgx_h100_topology_is_one_nvlink_domain_of_eight() -> None:
    m = parse_topo_matrix(DGX_H100)
    assert len(m) == 8 and m[0][0] == "X" and m[0][1] == "NV18" and m[7][6] == "NV18"
    assert nvlink_domains(m) == [list(range(8))]
    assert nvlink_domain_size(m) == 8
    assert nvlink_bandwidth_gbs(m) == 450.0  # 18 links x 25 GB/s each way


def test_pcie_only_gpus_are_domains_of_one() -> None:
    m = parse_topo_matrix(L40S_PCIE)
    assert m[0][:5] == ["X", "NODE", "NODE", "NODE", "SYS"]
    assert nvlink_domain_size(m) == 1 and nvlink_bandwidth_gbs(m) is None


def test_bridged_pairs_are_domains_of_two() -> None:
    m = parse_topo_matrix(BRIDGED_PAIRS)
    assert nvlink_domains(m) == [[0, 1], [2, 3]]
    assert nvlink_domain_size(m) == 2 and nvlink_bandwidth_gbs(m) == 100.0


def test_unaligned_or_missing_topology_is_conservative() -> None:
    odd = [["X", "NV4", "SYS"], ["NV4", "X", "SYS"], ["SYS", "SYS", "X"]]
    assert nvlink_domain_size(odd) == 1  # groups of 2 and 1
    assert parse_topo_matrix("") == [] and nvlink_domain_size([]) == 1


def test_slurm_node_lists() -> None:
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07",
                                                        "login1"]
    assert expand_nodelist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]
    assert expand_nodelist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    assert expand_nodelist("node7") == ["node7"]
    assert slurm_num_nodes({"SLURM_JOB_NUM_NODES": "4"}) == 4
    assert slurm_num_nodes({"SLURM_JOB_NODELIST": "h100-[001-002]"}) == 2
    assert slurm_num_nodes({}) is None


def test_two_dgx_h100_nodes_under_slurm() -> None:
    c = cluster_from_gpus(names=["NVIDIA H100 80GB HBM3"] * 8, memory_bytes=[85_520_000_000] * 8,
                          topo_text=DGX_H100, env={"SLURM_JOB_NODELIST": "dgx[1-2]"})
    assert (c.num_nodes, c.devices_per_node, c.nvlink_domain_size) == (2, 8, 8)
    assert (c.memory_bandwidth_gbs, c.peak_tflops_bf16, c.intra_node_bandwidth_gbs) == (
        3350, 989, 450.0)
    assert c.inter_node_bandwidth_gbs == 50.0 and c.source == "detected"
    assert c.name == "detected-8xNVIDIA-H100-80GB-HBM3"
    assert c.device_memory_gb == 85.52


def test_l40s_server_without_topology_output() -> None:
    c = cluster_from_gpus(names=["NVIDIA L40S"] * 8, memory_bytes=[48_000_000_000] * 8,
                          topo_text="", env={})
    assert (c.num_nodes, c.nvlink_domain_size, c.intra_node_bandwidth_gbs) == (1, 1, 25.0)
    assert c.peak_tflops_bf16 == 362


def test_gpu_spec_lookup() -> None:
    spec = gpu_spec("NVIDIA H200")
    assert spec is not None and (spec.memory_gb, spec.bandwidth_gbs) == (141, 4800)
    h100_pcie = gpu_spec("NVIDIA H100 PCIe")
    assert h100_pcie is not None and h100_pcie.bandwidth_gbs == 2000
    assert gpu_spec("Tesla T4") is None
