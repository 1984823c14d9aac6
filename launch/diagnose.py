"""`meshserve diagnose diagnose.records=steps.jsonl [model=... cluster=... parallel...]`:
split a workload's step time by cause against the cost model, name the bottleneck.

The records are JSON lines, one step each, with StepRecord's fields (parallel/diagnose.py).
The layout is the run's: its parallel degrees, or the planner's choice under parallel=auto.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

from meshserve.launch.config import load_config
from meshserve.launch.plan import resolve_arch, shorthand
from meshserve.parallel.cost_model import CostModel
from meshserve.parallel.diagnose import StepRecord, diagnose
from meshserve.parallel.model_shape import ModelShape
from meshserve.parallel.plan import layout_for
from meshserve.parallel.planner import plan_for, resolve_dtype


def read_records(path: str | None) -> tuple[list[StepRecord], str | None]:
    """StepRecords from a JSON-lines file, and a note when its last line was skipped: a
    running engine may be writing it (cut short, no newline yet). Other bad lines are
    errors naming the line and the field."""
    if not path:
        raise ValueError("diagnose.records=None is invalid: allowed is a JSON-lines file of "
                         "step records (one StepRecord's fields per line)")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"diagnose.records={path!r}: no such file")
    names = {f.name for f in fields(StepRecord)}
    records = []
    text = p.read_text(errors="replace")
    lines = text.splitlines()
    note = None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n"):
                note = f"{path}:{i}: skipped the last line, still being written ({len(line)} chars)"
                break
            raise ValueError(f"{path}:{i}: not JSON ({e})") from None
        unknown = set(row) - names
        if unknown:
            raise ValueError(f"{path}:{i}: unknown field(s) {sorted(unknown)}; allowed: "
                             f"{', '.join(sorted(names))}")
        try:
            records.append(StepRecord(**row))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}:{i}: {e}") from None
    return records, note


def run(overrides: list[str]) -> int:
    """Read the records, diagnose, print; returns the exit code."""
    cfg = load_config(shorthand(overrides, "diagnose"))
    records, note = read_records(cfg.diagnose.records)
    if note:
        print(f"meshserve diagnose: {note}", file=sys.stderr)
    arch = resolve_arch(cfg.model)
    plan = plan_for(cfg, arch)
    shape = ModelShape.from_arch(arch, resolve_dtype(cfg.model.dtype, arch.dtype,
                                                     cfg.cluster.device_type))
    cost = CostModel(shape, cfg.cluster, layout_for(plan.tp, list(plan.stage_layers),
                                                    plan.num_micro_batches, cfg.cluster))
    d = diagnose(records, cost, cfg.scenario.name)
    if cfg.diagnose.format == "json":
        print(json.dumps({"model": cfg.model.name, "cluster": cfg.cluster.name, "tp": plan.tp,
                          "pp": plan.pp, "dp": plan.dp, **d.as_dict()}, indent=1))
        return 0
    print(f"{d.num_steps} steps, {d.total_s:.3f} s: {cfg.model.name} ({shape.dtype}) on "
          f"{cfg.cluster.name}, tp={plan.tp} pp={plan.pp} dp={plan.dp}")
    for cause, secs in d.seconds.items():
        print(f"  {cause.replace('_', ' '):18s} {secs:10.4f} s  {d.shares[cause]:6.1%}")
    executor = d.total_s - d.seconds["scheduler"]
    print(f"the cost model predicts {d.predicted_s:.4f} s of the {executor:.4f} s the "
          f"executor took ({d.model_accuracy:.0%})")
    print(f"bottleneck: {d.bottleneck.replace('_', ' ')}: {d.strategy}")
    return 0
