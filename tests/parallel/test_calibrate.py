"""calibrate: fitting latency and bandwidth, the written preset, one real run with 2 ranks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshserve.parallel.planner.calibration import (
    Calibration,
    CollectiveTimes,
    allreduce_link,
    fit_line,
    preset_yaml,
)
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.cost_model import p2p_s, ring_allreduce_s

SIZES = [4096, 1 << 16, 1 << 20, 1 << 23]


def test_fit_recovers_the_ring_allreduce_model() -> None:
    for world, lat, bw in ((2, 300e-6, 2.2e9), (4, 1.5e-6, 450e9)):
        times = [ring_allreduce_s(world, s, bw, lat) for s in SIZES]
        got_lat, got_bw = allreduce_link(world, *fit_line(SIZES, times))
        assert got_lat == pytest.approx(lat) and got_bw == pytest.approx(bw)


def test_fit_clips_noise_to_physical_values() -> None:
    assert fit_line([1, 2, 3], [3.0, 2.0, 1.0]) == (2.0, 0.0)  # time can't fall with size
    assert fit_line([1, 2], [-1.0, 1.0]) == (0.0, 2.0)


def calibration() -> Calibration:
    times = CollectiveTimes(world=2, sizes=SIZES,
                            allreduce_s=[ring_allreduce_s(2, s, 2e9, 500e-6) for s in SIZES],
                            p2p_s=[p2p_s(s, 4e9, 100e-6) for s in SIZES], concurrent_gemv_gbs=15.0)
    return Calibration(device_type="cpu", tflops={"float32": 0.08123456, "bfloat16": 0.15},
                       read_gbs=27.0, gemv_gbs=20.0, layer_overhead_us=61.23, collectives=[times])


def test_calibration_becomes_a_cluster_preset() -> None:
    cal = calibration()
    assert cal.links() == {"allreduce-2": (pytest.approx(500.0), pytest.approx(2.0)),
                           "p2p": (pytest.approx(100.0), pytest.approx(4.0))}
    c = cal.to_cluster(ClusterConfig(), "here")
    assert (c.name, c.source, c.memory_bandwidth_gbs, c.node_memory_bandwidth_gbs) == (
        "here", "calibrated", 20.0, 30.0)
    assert (c.peak_tflops_fp32, c.peak_tflops_bf16, c.layer_overhead_us) == (0.08123, 0.15, 61.2)
    assert (c.intra_node_latency_us, c.intra_node_bandwidth_gbs) == (500.0, 2.0)
    data = yaml.safe_load(preset_yaml(c, cal))
    assert data.pop("defaults") == ["cluster_schema"]
    assert ClusterConfig(**data) == c


@pytest.mark.slow
def test_calibrate_verb_measures_this_machine(tmp_path: Path) -> None:
    out = tmp_path / "mine.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [str(Path(sys.executable).with_name("meshserve")), "calibrate", "device=cpu",
         f"calibrate.out={out}", "calibrate.name=mine", "calibrate.read_bytes=8388608",
         "calibrate.matmul_size=128", "calibrate.repeats=2",
         "calibrate.message_bytes=[4096,262144]", "calibrate.runtime_tokens=8"],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    data = yaml.safe_load(out.read_text())
    data.pop("defaults")
    c = ClusterConfig(**data)
    assert c.name == "mine" and c.source == "calibrated" and c.device_type == "cpu"
    assert c.memory_bandwidth_gbs > 0 and c.intra_node_bandwidth_gbs > 0
    assert "fit allreduce-2" in run.stdout and f"wrote {out}" in run.stdout
    assert "meshserve's engine at width 512 beyond the priced math" in run.stdout
    assert len(c.matmul_efficiency) == 9 and all(0 < e <= 1 for e in c.matmul_efficiency)
    # Residuals over the priced math, fitted and clamped at 0. With this quick calibration's
    # small matmuls and in-cache reads, and decode steps that run in one C call, the priced
    # math can cover a whole step, so every term may clip to 0 (the fit itself is tested
    # on known times below).
    parts = (c.layer_overhead_us, c.step_overhead_us, c.step_seq_overhead_us,
             c.seq_overhead_us)
    assert min(parts) >= 0


def test_attention_figures_reach_the_preset_only_when_measured() -> None:
    measured = dataclasses.replace(calibration(), kv_read_gbs=16.0, kv_row_ns=61.234,
                                   attention_efficiency=0.5512)
    c = measured.to_cluster(ClusterConfig(), "here")
    assert (c.kv_read_fraction, c.kv_row_overhead_ns, c.attention_efficiency) == (
        0.8, 61.2, 0.551)
    base = ClusterConfig(kv_read_fraction=0.5, kv_row_overhead_ns=9.0, attention_efficiency=0.7)
    c = calibration().to_cluster(base, "here")
    assert (c.kv_read_fraction, c.kv_row_overhead_ns, c.attention_efficiency) == (0.5, 9.0, 0.7)


def test_paged_attention_is_timed_per_row_and_fitted() -> None:
    import torch

    from meshserve.parallel.planner import calibration as cal

    cpu = torch.device("cpu")
    small = cal.kv_row_seconds(cpu, 1, 4, 32, batch=2, context=64, pool_bytes=1 << 20)
    large = cal.kv_row_seconds(cpu, 1, 8, 128, batch=2, context=64, pool_bytes=1 << 20)
    assert 0 < small < large < 1e-3  # seconds per cached token and layer
    gbs, row_ns = cal.kv_read_fit(cpu, 1)
    assert gbs > 0 and row_ns >= 0
    share = cal.attention_efficiency(cpu, 1, peak_tflops=10.0, chunk=64, cached=64)
    assert 0 < share < 1  # no CPU core computes 10 TFLOP/s


def test_without_collectives_the_links_stay_the_base_presets() -> None:
    cal = calibration()
    alone = Calibration(device_type="cuda", tflops={"float32": 60.0, "bfloat16": 790.0},
                        read_gbs=4300.0, gemv_gbs=4100.0, layer_overhead_us=12.0, collectives=[])
    base = ClusterConfig(name="dgx-h200", device_type="cuda", devices_per_node=8,
                         nvlink_domain_size=8, intra_node_bandwidth_gbs=450.0,
                         intra_node_latency_us=1.5)
    c = alone.to_cluster(base, "h200-here")
    assert (c.peak_tflops_bf16, c.memory_bandwidth_gbs, c.node_memory_bandwidth_gbs) == (
        790.0, 4100.0, None)
    assert (c.intra_node_bandwidth_gbs, c.intra_node_latency_us) == (450.0, 1.5)
    assert "No collectives measured" in preset_yaml(c, alone) and cal.collectives


def test_runtime_overheads_fit_per_step_layer_and_sequence() -> None:
    from meshserve.launch.runtime_overhead import BATCHES, DEPTHS, fit_overheads

    step, step_seq, layer, seq = 1e-3, 3e-5, 2e-4, 5e-5
    t = {(n, b): step + b * step_seq + n * (layer + b * seq) for n in DEPTHS for b in BATCHES}
    assert fit_overheads(t) == tuple(pytest.approx(x) for x in (step, step_seq, layer, seq))
    # What this CPU shows: per sequence per step, the same at every depth, a little noise
    # and the math over-pricing a step: every term stays >= 0 and the fit stays close.
    t = {(n, b): -1.3e-4 + b * 3.5e-5 + (2e-6 if n == 8 else -1e-6) for n, b in t}
    got = fit_overheads(t)
    assert min(got) >= 0 and got[1] == pytest.approx(3.5e-5, rel=0.1)
    assert got[2] < 2e-6 and got[3] < 2e-7
    # Residuals that fall with size (the math over-priced): nothing is left over.
    assert fit_overheads({(n, b): -1e-4 * n * b for n in DEPTHS for b in BATCHES}) == (0,) * 4


def test_priced_math_of_the_wide_calibration_models(tmp_path) -> None:
    from meshserve.launch.cli_config import load_config
    from meshserve.launch.runtime_overhead import WIDE, math_s, tiny_checkpoint

    cluster = load_config(["cluster=local-cpu"]).cluster
    one, four = (tiny_checkpoint(tmp_path / f"l{n}", n, shape=WIDE) for n in (1, 4))
    layer_bytes = 4 * WIDE.width * (2 * WIDE.width + 3 * WIDE.ffn)  # q, o, MLP: a lower bound
    assert math_s(one, cluster, 32, 1) > layer_bytes / (cluster.memory_bandwidth_gbs * 1e9)
    assert math_s(four, cluster, 32, 1) > 3 * math_s(one, cluster, 32, 1) * 0.9
    assert math_s(one, cluster, 32, 4) >= math_s(one, cluster, 32, 1)


def test_matmul_half_rows_is_measured_against_the_square_rate() -> None:
    import torch

    from meshserve.parallel.planner.calibration import matmul_half_rows

    # Against an impossible peak every size is far below it: a positive half point.
    assert matmul_half_rows(64, "float32", torch.device("cpu"), 2, peak_tflops=1e3,
                            weights_bytes=1 << 20) > 0
    # Against a peak of ~0 every size is above it: none.
    assert matmul_half_rows(64, "float32", torch.device("cpu"), 2, peak_tflops=1e-12,
                            weights_bytes=1 << 20) == 0
