"""`meshserve calibrate [cluster=<base>] [calibrate.name=...] [calibrate.out=...]`: measure
this machine (matmul rate, memory bandwidth, AllReduce and p2p per group size, and the
engine's own per-step and per-layer overhead) and write a cluster preset: the base preset
with the measured figures in place.

Use it afterwards as `cluster=<name>` (default: conf/cluster/calibrated.yaml). Run it on an
otherwise idle machine: other work on the cores shows up as a slower machine.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from meshserve.engine.config.run import resolve_device
from meshserve.launch.cli_config import CONF_DIR, load_config
from meshserve.launch.runtime_overhead import runtime_overhead_us
from meshserve.parallel.planner.calibration import calibrate, preset_yaml, sig


def run(overrides: list[str]) -> int:
    """Measure, write the preset, print what was measured; returns the exit code."""
    cfg = load_config(overrides)
    opts = cfg.calibrate
    device = torch.device(resolve_device(cfg.device))
    if device.type == "cuda" and max(opts.world_sizes, default=0) > torch.cuda.device_count():
        raise ValueError(f"calibrate.world_sizes={opts.world_sizes} is invalid: allowed is at "
                         f"most the {torch.cuda.device_count()} visible GPUs")
    cal = calibrate(world_sizes=list(opts.world_sizes), sizes=list(opts.message_bytes),
                    read_bytes=opts.read_bytes, matmul_size=opts.matmul_size,
                    repeats=opts.repeats, device=device)
    cluster = cal.to_cluster(cfg.cluster, opts.name)
    notes = []
    if opts.runtime:
        step_us, step_seq_us, layer_us, seq_us = runtime_overhead_us(
            device.type, opts.runtime_tokens, cluster)
        cluster = replace(cluster, step_overhead_us=sig(step_us, 3),
                          step_seq_overhead_us=sig(step_seq_us, 3),
                          layer_overhead_us=sig(layer_us, 3), seq_overhead_us=sig(seq_us, 3))
        notes.append(f"meshserve's engine at width 512 beyond the priced math: {step_us:.0f} "
                     f"us per step + {step_seq_us:.0f} us per sequence per step + {layer_us:.0f} "
                     f"us per layer + {seq_us:.0f} us per sequence per layer (these set the "
                     "overheads below)")
    out = Path(opts.out).expanduser() if opts.out else CONF_DIR / "cluster" / f"{opts.name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = preset_yaml(cluster, cal, notes)
    out.write_text(text)
    print("\n".join(line for line in text.splitlines() if line.startswith("#")))
    print(f"wrote {out} (use it as cluster={opts.name} when it is in conf/cluster/)")
    return 0
