"""`meshserve diagnose diagnose.records=steps.jsonl [model=... cluster=... parallel...]`:
split a workload's step time by cause against the cost model, name the bottleneck.

The records are JSON lines, one step each, with StepRecord's fields (parallel/planner/diagnosis.py).
An engine starts its records with a `{"run": {...}}` line; the model, dtype, layout,
scenario and cluster preset come from there unless given on the command line. A file that
several runs appended to is diagnosed for its last run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from meshserve.launch.cli_config import load_config, presets
from meshserve.launch.plan import shorthand
from meshserve.models.bundled import resolve_arch
from meshserve.parallel.planner.cost_model import CostModel
from meshserve.parallel.planner.diagnosis import StepRecord, diagnose, measured_bubble_s
from meshserve.parallel.planner.placement import layout_for
from meshserve.parallel.planner.search import plan_for, shape_for
from meshserve.parallel.planner.stages import head_first_fraction

RUN_OVERRIDES = {"model_path": "model.path", "model_name": "model.name", "dtype": "model.dtype",
                 "tp": "parallel.tp", "pp": "parallel.pp", "scenario": "scenario",
                 "cluster": "cluster"}
"""A run header's fields and the config keys they set."""


@dataclass
class Records:
    """A step-records file read for diagnosis: the last run's records and header."""

    steps: list[StepRecord] = field(default_factory=list)
    run: dict[str, Any] | None = None
    """The last run's header (None in files written before engines wrote headers)."""
    notes: list[str] = field(default_factory=list)
    stages: list[list[dict[str, Any]]] = field(default_factory=list)
    """A pipeline's snapshots of its ranks' cumulative stage times, in order."""


def read_records(path: str | None) -> Records:
    """The last run's StepRecords from a JSON-lines file, with notes when earlier runs or a
    last line still being written (cut short, no newline yet) were skipped. Other bad lines
    are errors naming the line and the field."""
    if not path:
        raise ValueError("diagnose.records=None is invalid: allowed is a JSON-lines file of "
                         "step records (one StepRecord's fields per line)")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"diagnose.records={path!r}: no such file")
    names = {f.name for f in fields(StepRecord)}
    out = Records()
    earlier = 0
    text = p.read_text(errors="replace")
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n"):
                out.notes.append(f"{path}:{i}: skipped the last line, still being written "
                                 f"({len(line)} chars)")
                break
            raise ValueError(f"{path}:{i}: not JSON ({e})") from None
        if "run" in row:  # a new run starts: diagnose from here on
            earlier += 1 if out.steps or out.run is not None else 0
            out.steps, out.run, out.stages = [], dict(row["run"]), []
            continue
        if "stages" in row:
            out.stages.append(list(row["stages"]))
            continue
        unknown = set(row) - names
        if unknown:
            raise ValueError(f"{path}:{i}: unknown field(s) {sorted(unknown)}; allowed: "
                             f"{', '.join(sorted(names))}")
        try:
            out.steps.append(StepRecord(**row))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}:{i}: {e}") from None
    if earlier:
        out.notes.insert(0, f"{path}: {earlier} earlier run(s) in the file skipped; "
                            "diagnosing the last one")
    return out


def run_overrides(run: dict[str, Any] | None, given: list[str]) -> list[str]:
    """Config overrides from a run header for every key the command line leaves unset (a
    cluster only when it is a preset: a calibrated file must be passed again)."""
    if not run:
        return []
    set_keys = {ov.split("=", 1)[0].lstrip("+~") for ov in given}
    if any(k.startswith("parallel") for k in set_keys):
        set_keys |= {"parallel.tp", "parallel.pp"}
    out = []
    for field_name, key in RUN_OVERRIDES.items():
        value = run.get(field_name)
        if value is None or key in set_keys:
            continue
        if key == "cluster" and value not in presets("cluster"):
            continue
        out.append(f"{key}='{value}'" if key.startswith("model.") and key != "model.dtype"
                   else f"{key}={value}")
    return out


def run(overrides: list[str]) -> int:
    """Read the records, diagnose, print; returns the exit code."""
    given = shorthand(overrides, "diagnose")
    records = read_records(load_config(given).diagnose.records)
    for note in records.notes:
        print(f"meshserve diagnose: {note}", file=sys.stderr)
    layout = run_overrides(records.run, given)
    if records.run is None and not any(ov.lstrip("+~").startswith("parallel") for ov in given):
        layout = ["parallel=single"]  # not the planner's guess: the run's, which is unknown
        print("meshserve diagnose: the records have no run header naming their layout; "
              "assuming one rank (give parallel.tp=... parallel.pp=... otherwise)",
              file=sys.stderr)
    cfg = load_config(layout + given)
    arch = resolve_arch(cfg.model)
    plan = plan_for(cfg, arch)
    shape = shape_for(cfg, arch, cfg.cluster.device_type)
    split = head_first_fraction(cfg.parallel.split_lm_head, plan.tp, plan.pp,
                                cfg.cluster.device_type)
    cost = CostModel(shape, cfg.cluster, layout_for(plan.tp, list(plan.stage_layers),
                                                    plan.num_micro_batches, cfg.cluster, split))
    target = (records.run or {}).get("tpot_slo_ms", cfg.scenario.tpot_slo_ms)
    bubble = (measured_bubble_s(records.stages[0], records.stages[-1],
                                sum(r.scheduler_s for r in records.steps))
              if len(records.stages) >= 2 else None)
    d = diagnose(records.steps, cost, cfg.scenario.name, float(target) / 1e3, bubble)
    if cfg.diagnose.format == "json":
        print(json.dumps({"model": cfg.model.label, "cluster": cfg.cluster.name, "tp": plan.tp,
                          "pp": plan.pp, "dp": plan.dp, **d.as_dict()}, indent=1))
        return 0
    print(f"{d.num_steps} steps, {d.total_s:.3f} s: {cfg.model.label} ({shape.dtype}) on "
          f"{cfg.cluster.name}, tp={plan.tp} pp={plan.pp} dp={plan.dp}")
    for cause, secs in d.seconds.items():
        print(f"  {cause.replace('_', ' '):18s} {secs:10.4f} s  {d.shares[cause]:6.1%}  "
              f"({d.sources[cause]})")
    executor = d.total_s - d.seconds["scheduler"]
    print(f"the cost model predicts {d.predicted_s:.4f} s of the {executor:.4f} s the "
          f"executor took ({d.model_accuracy:.0%})")
    print(f"bottleneck: {d.bottleneck.replace('_', ' ')}: {d.strategy}")
    sp = d.speculation
    if sp is not None:
        print(f"speculative decoding: {sp.num_drafted_steps} of {d.num_steps} steps drafted "
              f"({sp.num_decode_steps} decode-only steps in all); {sp.num_accepted_tokens} of "
              f"{sp.num_draft_tokens} drafts accepted ({sp.acceptance_rate:.0%}), "
              f"{sp.tokens_per_decode:.2f} tokens per decoding sequence per drafted step; "
              f"{sp.verdict}")
    if d.step_budget is not None:
        print(d.step_budget.describe())
    return 0
