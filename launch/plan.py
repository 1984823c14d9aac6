"""`meshserve plan`: rank (tp, pp, dp) layouts of a model on a cluster for a scenario.

With `disagg=auto` it also ranks prefill/decode splits (each phase's replicas, tp and pp,
the KV hop priced on the link it crosses) and says which kind serves the scenario better.

`meshserve plan model=llama-3-70b cluster=dgx-h100-2node scenario=chatbot [format=json]`
prints every candidate (memory per device, KV capacity, predicted TTFT / TPOT / throughput,
or why it was rejected), the choice with its reasons, and the chosen rank map.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict
from typing import Any

from meshserve.launch.cli_config import load_config
from meshserve.launch.options import CliConfig
from meshserve.models.bundled import resolve_arch
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.disagg_search import (
    KindChoice,
    Phase,
    SplitCandidate,
    choose_kind,
)
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.placement import Plan
from meshserve.parallel.planner.prediction import DRAFT_STEP_FRACTION, SPEC_ACCEPTED, SPEC_TOKENS
from meshserve.parallel.planner.search import (
    Candidate,
    PlannerOptions,
    Predicted,
    options_for,
    plan,
    shape_for,
)
from meshserve.parallel.planner.topology import detect_cluster


def shorthand(overrides: list[str], verb: str) -> list[str]:
    """Let `format=json` stand for `<verb>.format=json`."""
    return [f"{verb}.{ov}" if ov.startswith("format=") else ov for ov in overrides]


def model_shape(cfg: CliConfig, cluster: ClusterConfig) -> ModelShape:
    """The cost model's view of the configured model in the dtype it will run in."""
    arch = resolve_arch(cfg.model)
    return shape_for(cfg, arch, cluster.device_type)


def planning_cluster(cfg: CliConfig) -> ClusterConfig:
    """The cluster preset, or this machine's GPUs with plan.detect=true."""
    if not cfg.plan.detect:
        return cfg.cluster
    detected = detect_cluster()
    if detected is None:
        raise ValueError("plan.detect=true found no CUDA devices; allowed on a GPU machine, "
                         "else pick a preset with cluster=<name>")
    return detected


def run(overrides: list[str]) -> int:
    """Plan and print; returns the exit code."""
    cfg = load_config(shorthand(overrides, "plan"))
    cluster = planning_cluster(cfg)
    shape = model_shape(cfg, cluster)
    options = PlannerOptions(**{**asdict(options_for(cfg)),
                                "allow_cross_domain_tp": cfg.plan.allow_cross_domain_tp,
                                "simulate": cfg.plan.simulate})
    if cfg.disagg.mode == "auto":
        choice = choose_kind(shape, cluster, cfg.scenario, options)
        chosen = choice.colocated
    else:
        choice, chosen = None, plan(shape, cluster, cfg.scenario, options)
    if cfg.plan.format == "json":
        doc = plan_json(chosen, cfg, cluster, shape)
        if choice is not None:
            doc["disagg"] = split_json(choice)
        print(json.dumps(doc, indent=1))
    else:
        print(plan_table(chosen, cfg, cluster, shape))
        if choice is not None:
            print("\n" + split_table(choice, cfg.plan.top))
    return 0


def split_dict(c: SplitCandidate) -> dict[str, Any]:
    """One prefill/decode split for the JSON output."""
    def phase(p: Phase) -> dict[str, Any]:
        return {"replicas": p.replicas, "tp": p.tp, "pp": p.pp,
                "weight_gb_per_device": round(p.sizing.weight_gb, 3),
                "kv_capacity_tokens": p.sizing.kv_capacity_tokens}

    return {"prefill": phase(c.prefill), "decode": phase(c.decode), "link": c.link,
            "kv_bytes_per_request": round(c.kv_bytes), "transfer_ms": round(c.transfer_ms, 4),
            "prefill_capacity_req_s": round(c.prefill_capacity_req_s, 4),
            "decode_capacity_req_s": round(c.decode_capacity_req_s, 4),
            "predicted": prediction_dict(c), "rejected": c.rejected}


def split_json(choice: KindChoice) -> dict[str, Any]:
    """disagg=auto's answer as JSON: the kind chosen, why, and every split."""
    doc: dict[str, Any] = {"chosen": choice.kind, "explanation": choice.explanation,
                           "splits": [split_dict(c) for c in choice.splits]}
    if choice.simulated_goodput_req_s is not None:
        colocated, split = choice.simulated_goodput_req_s
        doc["simulated_goodput_req_s"] = {"colocated": round(colocated, 4),
                                          "split": round(split, 4)}
    return doc


SPLIT_COLUMNS = ("", "prefill", "decode", "KV hop", "prefill req/s", "decode req/s",
                 "batch", "TTFT ms", "TPOT ms", "tok/s", "goodput/s", "note")


def split_row(i: int, c: SplitCandidate) -> list[str]:
    """One split's row: its phases, the hop, each side's capacity and the predictions."""
    head = [str(i + 1) if c.rejected is None else "-", c.prefill.text, c.decode.text]
    p = c.prediction
    if p is None:
        return head + [""] * 8 + [f"rejected: {c.rejected}"]
    note = f"bound by {c.bound_by}" + ("" if p.meets_slo else ", misses the SLOs")
    return head + [f"{c.kv_bytes / 1e6:.3g} MB {c.transfer_ms:.2f} ms {c.link}",
                   f"{c.prefill_capacity_req_s:.3g}", f"{c.decode_capacity_req_s:.3g}",
                   str(p.batch), f"{p.ttft_ms:.1f}", f"{p.tpot_ms:.2f}",
                   f"{p.throughput_tok_s:,.0f}", f"{p.goodput_req_s:.2f}", note]


SPLIT_ROWS = 10
"""Splits the table shows unless plan.top says otherwise (a large cluster has hundreds)."""


def split_table(choice: KindChoice, top: int) -> str:
    """disagg=auto's splits, best first (the first `top`, else SPLIT_ROWS), and the kind
    chosen."""
    shown = choice.splits[:top or SPLIT_ROWS]
    lines = ["prefill/decode splits (disagg=auto):", ""]
    lines += table([list(SPLIT_COLUMNS)] + [split_row(i, c) for i, c in enumerate(shown)], 0)
    if len(shown) < len(choice.splits):
        lines.append(f"... {len(choice.splits) - len(shown)} more (plan.top=N shows N; "
                     "format=json lists all)")
    lines += ["", f"chosen: {choice.kind} serving", textwrap.fill(choice.explanation, 100)]
    split = choice.split
    if choice.kind == "disaggregated" and split is not None:
        lines.append(f"start it with: disagg=manual disagg.prefill.replicas="
                     f"{split.prefill.replicas} disagg.prefill.tp={split.prefill.tp} "
                     f"disagg.prefill.pp={split.prefill.pp} disagg.decode.replicas="
                     f"{split.decode.replicas} disagg.decode.tp={split.decode.tp} "
                     f"disagg.decode.pp={split.decode.pp}"
                     + (" (or disagg=auto disagg.simulate=true)" if choice.simulated_goodput_req_s
                        else " (or disagg=auto)"))
    return "\n".join(lines)


def prediction_dict(c: Predicted) -> dict[str, Any] | None:
    """A candidate's (or a split's) predicted figures, rounded for reading."""
    if c.prediction is None:
        return None
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(c.prediction).items()}


def candidate_dict(c: Candidate) -> dict[str, Any]:
    """One candidate for the JSON output."""
    return {"tp": c.tp, "pp": c.pp, "dp": c.dp, "stage_layers": [list(r) for r in c.stage_layers],
            "weight_gb_per_device": round(c.weight_gb, 3),
            "activation_gb_per_device": round(c.activation_gb, 3),
            "kv_capacity_tokens": c.kv_capacity_tokens, "predicted": prediction_dict(c),
            "rejected": c.rejected, "warning": c.warning}


def plan_json(p: Plan, cfg: CliConfig, cluster: ClusterConfig, shape: ModelShape) -> dict[str, Any]:
    """The plan as JSON: chosen degrees and predictions first, then candidates and ranks."""
    best = p.candidates[0]
    return {
        "model": cfg.model.label, "num_params": shape.num_params, "dtype": shape.dtype,
        "cluster": cluster.name, "scenario": cfg.scenario.name,
        "objective": cfg.scenario.objective,
        "tp": p.tp, "pp": p.pp, "dp": p.dp, "num_micro_batches": p.num_micro_batches,
        "stage_layers": [list(r) for r in p.stage_layers],
        "predicted": prediction_dict(best), "weight_gb_per_device": round(best.weight_gb, 3),
        "kv_capacity_tokens": best.kv_capacity_tokens,
        "warnings": list(p.warnings), "explanation": p.explanation,
        "candidates": [candidate_dict(c) for c in p.candidates],
        "rank_map": [asdict(pl) for pl in p.placements],
    }


COLUMNS = ("", "tp", "pp", "dp", "weights/dev", "KV tokens", "max req", "batch", "TTFT ms",
           "TPOT ms", "tok/s", "goodput/s", "note")


def candidate_row(i: int, c: Candidate) -> list[str]:
    """One table row: rank (* for the chosen), degrees, memory, predictions or the reason."""
    head = ["*1" if i == 0 else (str(i + 1) if c.rejected is None else "-"),
            str(c.tp), str(c.pp), str(c.dp), f"{c.weight_gb:.1f} GB"]
    p = c.prediction
    if p is None:
        return head + [""] * 7 + [f"rejected: {c.rejected}"]
    note = (f"rejected: {c.rejected}" if c.rejected else c.warning) or (
        "" if p.meets_slo else "misses the SLOs")
    return head + [f"{c.kv_capacity_tokens:,}", str(p.max_concurrency), str(p.batch),
                   f"{p.ttft_ms:.1f}", f"{p.tpot_ms:.2f}", f"{p.throughput_tok_s:,.0f}",
                   f"{p.goodput_req_s:.2f}", note]


def table(rows: list[list[str]], right: int) -> list[str]:
    """Aligned text columns; the first `right` columns after the first are right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [v.rjust(w) if 0 < i <= right else v.ljust(w)
                 for i, (v, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def plan_table(p: Plan, cfg: CliConfig, cluster: ClusterConfig, shape: ModelShape) -> str:
    """The human-readable plan."""
    sc = cfg.scenario
    shown = p.candidates if not cfg.plan.top else p.candidates[:cfg.plan.top]
    lines = [
        f"model {cfg.model.label} ({shape.num_params / 1e9:.1f}B params, {shape.dtype}) on "
        f"{cluster.name} ({cluster.num_nodes} x {cluster.devices_per_node} "
        f"{cluster.device_name or cluster.device_type}, NVLink domain "
        f"{cluster.nvlink_domain_size}, {cluster.source})",
        f"scenario {sc.name}: {sc.objective}; prompt {sc.prompt_len}, output {sc.output_len}, "
        f"prefix hit {sc.shared_prefix_fraction:g}, max batch {sc.max_batch}; SLO TTFT "
        f"{sc.ttft_slo_ms:g} ms, TPOT {sc.tpot_slo_ms:g} ms", ""]
    lines += table([list(COLUMNS)] + [candidate_row(i, c) for i, c in enumerate(shown)], 11)
    if len(shown) < len(p.candidates):
        lines.append(f"... {len(p.candidates) - len(shown)} more (plan.top=0 shows all)")
    lines += ["", textwrap.fill(p.explanation, 100)]
    best = p.candidates[0].prediction
    if best is not None and best.speculative_decode_ms is not None:
        pays = best.speculative_decode_ms < best.decode_ms
        lines += [textwrap.fill(
            f"speculative decoding ({sc.name} speculates): the decode round at batch "
            f"{best.batch} takes {best.speculative_decode_ms:.2f} ms per output token with "
            f"drafts against {best.decode_ms:.2f} ms without, assuming {SPEC_ACCEPTED:g} of "
            f"{SPEC_TOKENS} drafts accepted per verify step and a draft step at "
            f"{DRAFT_STEP_FRACTION:.0%} of the target's; "
            + ("it pays there, and the engine's switch would draft" if pays else
               "it does not pay there: the engine's switch would decode plainly at this "
               "batch"), 100)]
    lines += [f"warning: {w}" for w in p.warnings]
    stages = ", ".join(f"stage {i}: layers {a}-{b - 1}" for i, (a, b) in enumerate(p.stage_layers))
    lines += ["", f"chosen: tp={p.tp} pp={p.pp} dp={p.dp}, {p.num_micro_batches} micro-batch(es); "
              f"{stages}", ""]
    ranks = [["rank", "node", "device", "dp", "pp", "tp", "role"]] + [
        [str(pl.rank), str(pl.node), str(pl.local_device), str(pl.dp_rank), str(pl.pp_rank),
         str(pl.tp_rank), pl.role] for pl in p.placements]
    lines += table(ranks, 5)
    return "\n".join(lines)
