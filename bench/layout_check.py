"""Does the cost model predict this machine? Measured vs predicted step times per layout.

    python -m meshserve.bench.layout_check --out DIR [--cluster calibrated] [--model tiny]

For each tp x pp layout (default 1x1, 2x1, 1x2, 2x2) a fresh process runs a fixed workload
(`batch` prompts of `prompt_len` tokens, `max_tokens` each, prefix caching off) with
self-spawned CPU ranks of `threads` threads each (OMP_NUM_THREADS per rank), once to warm
up and once measured with the engine's step records (engine.step_log). The same records
are predicted by the cost model for that layout, its stage layer ranges (the ones the
runtime loads) and the cluster preset, exactly as `meshserve diagnose` predicts them:

- prefill: the wall time of the steps that only prefill (the whole batch's prompts; at
  pp > 1 predicted as one burst into an empty pipeline, its fill and drain included);
- decode: wall time per token of every sequence (TPOT at `batch`) over the steps that
  only decode: the step time at pp = 1, a pipeline round of micro-batches at pp > 1.

Prints a table (layout, predicted and measured ms, error, rank of each layout by predicted
and by measured time) and writes DIR/layout_check.json. Run it on an idle machine with at
least tp·pp·threads cores, after `meshserve calibrate` (the target: within 20% and the same
order with the calibrated CPU preset).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from meshserve.bench import checkpoints
from meshserve.compose import CONF_DIR
from meshserve.engine.config.runtime_config import RuntimeConfig, load_runtime_config
from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.cost_model import CostModel, StepWork
from meshserve.parallel.planner.diagnosis import StepRecord, record_cost
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.placement import layout_for
from meshserve.parallel.planner.search import resolve_dtype, runtime_stage_ranges
from meshserve.parallel.planner.stages import head_first_fraction

PHASES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The fixed batch every layout runs."""

    batch: int = 8
    """Sequences, all arriving at once."""
    prompt_len: int = 64
    """Prompt tokens each (distinct prompts, no prefix caching)."""
    max_tokens: int = 32
    """Tokens generated each (EOS ignored)."""
    threads: int = 1
    """torch threads (and OMP_NUM_THREADS) per rank."""


def load_cluster(name_or_file: str) -> ClusterConfig:
    """A cluster preset by name (conf/cluster/NAME.yaml) or from a YAML file (as written by
    `meshserve calibrate calibrate.out=FILE`)."""
    path = Path(name_or_file).expanduser()
    if not path.is_file():
        if not (CONF_DIR / "cluster" / f"{name_or_file}.yaml").is_file():
            raise ValueError(f"--cluster {name_or_file!r}: neither a preset in "
                             f"{CONF_DIR / 'cluster'} nor a YAML file")
        return load_runtime_config([f"cluster={name_or_file}"]).cluster
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(raw, dict), path
    return ClusterConfig(**{k: v for k, v in raw.items() if k != "defaults"})


def layout_cluster(cluster: ClusterConfig, world_size: int) -> ClusterConfig:
    """The preset as one node of `world_size` ranks when it has fewer devices (a CPU preset
    describes cores of one machine: every rank shares its memory and links)."""
    if cluster.num_devices >= world_size:
        return cluster
    return dataclasses.replace(cluster, num_nodes=1, devices_per_node=world_size,
                               nvlink_domain_size=world_size)


def layout_config(base: RuntimeConfig, model_dir: Path, tp: int, pp: int, step_log: Path,
                  work: Workload) -> RuntimeConfig:
    """The run's config: the model, the layout, its cluster, CPU ranks, step records on."""
    return dataclasses.replace(
        base, device="cpu", threads=work.threads,
        model=dataclasses.replace(base.model, path=str(model_dir), name=model_dir.name),
        parallel=dataclasses.replace(base.parallel, auto=False, tp=tp, pp=pp, dp=1),
        cluster=layout_cluster(base.cluster, tp * pp),
        engine=dataclasses.replace(base.engine, enable_prefix_caching=False,
                                   step_log=str(step_log)))


def measure(config: RuntimeConfig, work: Workload) -> list[StepRecord]:
    """Warm up, then run the workload once; its step records (in a fresh process)."""
    from meshserve.engine.core.sampling_params import SamplingParams
    from meshserve.engine.llm import LLM

    params = SamplingParams(max_tokens=work.max_tokens, ignore_eos=True)
    vocab = ModelArch.from_dir(Path(config.model.path)).vocab_size

    def prompts(round_: int) -> list[list[int]]:
        return [[(7 + 131 * (round_ * work.batch + i) + 17 * t) % vocab
                 for t in range(work.prompt_len)] for i in range(work.batch)]

    log_path = Path(config.engine.step_log or "")
    with LLM(config=config, progress=False) as llm:
        log = llm.engine.step_log
        assert log is not None
        llm.generate(prompts(0), params, use_tqdm=False)
        log.flush()
        skip = len(log_path.read_text().splitlines())
        llm.generate(prompts(1), params, use_tqdm=False)
        log.flush()
        lines = log_path.read_text().splitlines()[skip:]
    return [StepRecord(**json.loads(line)) for line in lines]


def run_layout(config: RuntimeConfig, work: Workload) -> list[StepRecord]:
    """`measure` in a fresh process (one multi-rank run per process; a clean torch)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(work.threads)  # the driver's, inherited by the child
    try:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            return pool.submit(measure, config, work).result()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def phase_times(records: list[StepRecord], cost: CostModel,
                batch: int) -> dict[str, dict[str, float]]:
    """Measured and predicted seconds per phase (see the module docstring)."""
    out: dict[str, dict[str, float]] = {}
    for phase in PHASES:
        if phase == "prefill":
            rows = [r for r in records if r.num_prefill_seqs and not r.num_decode_seqs]
        else:
            rows = [r for r in records if r.num_decode_seqs and not r.num_prefill_seqs]
        measured = sum(r.wall_s for r in rows)
        if phase == "prefill" and cost.layout.pp > 1 and rows:
            # The prompts arrive together into an empty pipeline: one burst of micro-batches,
            # whose fill and drain no other work hides.
            burst = sum((r.work() for r in rows), StepWork())
            predicted = cost.step(burst, len(rows), isolated=True).total_s
        else:
            predicted = sum(record_cost(cost, r.work(), r.num_in_flight).total_s for r in rows)
        rounds = sum(r.num_decode_seqs for r in rows) / batch if phase == "decode" else 1.0
        out[phase] = {"measured_s": measured / (rounds or 1.0),
                      "predicted_s": predicted / (rounds or 1.0), "num_steps": len(rows)}
    return out


def cost_for(config: RuntimeConfig, arch: ModelArch) -> tuple[CostModel, list[tuple[int, int]]]:
    """The cost model of the config's layout, with the stage ranges the runtime loads."""
    p = config.parallel
    ranges = runtime_stage_ranges(config, arch, p.tp, p.pp)
    dtype = resolve_dtype(config.model.dtype, arch.dtype, config.cluster.device_type)
    m = (p.num_micro_batches or p.pp) if p.pp > 1 else 1
    split = head_first_fraction(p.split_lm_head, p.tp, p.pp, "cpu")
    return CostModel(ModelShape.from_arch(arch, dtype), config.cluster,
                     layout_for(p.tp, ranges, m, config.cluster, split)), ranges


def ranks(values: list[float]) -> list[int]:
    """1 for the smallest value, 2 for the next, ..."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return [order.index(i) + 1 for i in range(len(values))]


def check(model: str, cluster: str, layouts: list[tuple[int, int]], work: Workload,
          out: Path) -> dict[str, Any]:
    """Measure and predict every layout; the result document (also written to `out`)."""
    model_dir = checkpoints.resolve(model)
    arch = ModelArch.from_dir(model_dir)
    base = dataclasses.replace(load_runtime_config([]), cluster=load_cluster(cluster))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshserve-layout-check-") as tmp:
        for tp, pp in layouts:
            config = layout_config(base, model_dir, tp, pp, Path(tmp) / f"{tp}x{pp}.jsonl",
                                   work)
            cost, ranges = cost_for(config, arch)
            records = run_layout(config, work)
            rows.append({"tp": tp, "pp": pp, "stage_layers": ranges,
                         **phase_times(records, cost, work.batch)})
    for phase in PHASES:
        for key in ("measured_s", "predicted_s"):
            for row, r in zip(rows, ranks([row[phase][key] for row in rows])):
                row[phase][key.replace("_s", "_rank")] = r
        for row in rows:
            p = row[phase]
            p["error"] = p["predicted_s"] / p["measured_s"] - 1 if p["measured_s"] else None
    doc = {"model": str(model_dir), "cluster": base.cluster.name,
           "cluster_source": base.cluster.source, "workload": dataclasses.asdict(work),
           "cpus": os.cpu_count(), "layouts": rows,
           "order_matches": {ph: all(r[ph]["measured_rank"] == r[ph]["predicted_rank"]
                                     for r in rows) for ph in PHASES},
           "max_abs_error": {ph: max(abs(r[ph]["error"] or 0.0) for r in rows)
                             for ph in PHASES}}
    (out / "layout_check.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def table(doc: dict[str, Any]) -> str:
    """The result for people: one line per layout and phase, then the verdicts."""
    w = doc["workload"]
    lines = [f"{doc['model']} on cluster {doc['cluster']} ({doc['cluster_source']}); batch "
             f"{w['batch']} x {w['prompt_len']} prompt tokens, {w['max_tokens']} generated, "
             f"{w['threads']} thread(s) per rank",
             f"{'layout':8s} {'phase':8s} {'predicted ms':>12s} {'measured ms':>12s} "
             f"{'error':>8s} {'rank pred/meas':>15s}"]
    for row in doc["layouts"]:
        for ph in PHASES:
            p = row[ph]
            err = f"{p['error']:+.1%}" if p["error"] is not None else "n/a"
            name = f"tp{row['tp']} pp{row['pp']}"
            lines.append(f"{name:8s} {ph:8s} "
                         f"{1e3 * p['predicted_s']:12.2f} {1e3 * p['measured_s']:12.2f} "
                         f"{err:>8s} {p['predicted_rank']:>7d}/{p['measured_rank']}")
    for ph in PHASES:
        lines.append(f"{ph}: largest error {doc['max_abs_error'][ph]:.1%}, predicted order "
                     f"{'matches' if doc['order_matches'][ph] else 'differs from'} "
                     "the measured order")
    busy = max(r["tp"] * r["pp"] for r in doc["layouts"]) * w["threads"]
    if doc["cpus"] and busy > doc["cpus"]:
        lines.append(f"warning: {busy} threads on {doc['cpus']} CPUs: layouts share cores, "
                     "the measurements say little")
    return "\n".join(lines)


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """'1x1,2x1' -> [(1, 1), (2, 1)] (tp x pp)."""
    try:
        pairs = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise ValueError(f"--layouts {text!r}: allowed is a comma list of TPxPP, e.g. 1x1,2x1")
    return [(p[0], p[1]) for p in pairs]


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(prog="python -m meshserve.bench.layout_check",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for layout_check.json")
    ap.add_argument("--model", default="tiny", help="bench checkpoint name or HF directory")
    ap.add_argument("--cluster", default="local-cpu", help="preset name or preset YAML file")
    ap.add_argument("--layouts", default="1x1,2x1,1x2,2x2", help="TPxPP list")
    for f in dataclasses.fields(Workload):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default,
                        help=f"{f.name} (default {f.default})")
    args = ap.parse_args(argv)
    try:
        work = Workload(batch=args.batch, prompt_len=args.prompt_len,
                        max_tokens=args.max_tokens, threads=args.threads)
        doc = check(args.model, args.cluster, parse_layouts(args.layouts), work,
                    Path(args.out))
    except ValueError as e:
        print(f"layout_check: {e}", file=sys.stderr)
        return 2
    print(table(doc))
    print(f"wrote {Path(args.out) / 'layout_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
