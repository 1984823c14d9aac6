"""The sharding planner: enumerate (tp, pp, dp), apply the rules, rank for the scenario.

Rules: a TP group stays inside one NVLink domain unless no layout fits otherwise (then it
may cross, with a warning); pipeline stages may cross nodes; weights, activations and the
KV of at least one whole request must fit every device. Accepted candidates are ranked by
the scenario's objective; among those within `simplicity_margin` of the best, the simplest
(fewest stages, then least TP) is chosen, since the cost model ignores what extra stages
and wider TP cost in practice (imbalanced micro-batches, harder failure handling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from meshserve.parallel.comm.mesh import divisors
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.cost_model import CostModel, StageTime, StepWork
from meshserve.parallel.planner.model_shape import ArchLike, ModelShape
from meshserve.parallel.planner.placement import Plan, layout_for, place_ranks, tp_within_domain
from meshserve.parallel.planner.prediction import Prediction, predict
from meshserve.parallel.planner.scenario import ScenarioConfig
from meshserve.parallel.planner.stages import StageCosts, head_first_fraction, stage_layer_ranges
from meshserve.validation import require


class RunLike(Protocol):
    """What the planner reads of a run's configuration (the runtime's RuntimeConfig): the
    model's dtype, the engine's memory and step budget, the parallel knobs, the cluster and
    the scenario."""

    @property
    def model(self) -> Any: ...
    @property
    def engine(self) -> Any: ...
    @property
    def parallel(self) -> Any: ...
    @property
    def cluster(self) -> ClusterConfig: ...
    @property
    def scenario(self) -> ScenarioConfig: ...

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """Knobs of the planner beyond model, cluster and scenario."""

    memory_utilization: float = 0.9
    """Share of each device's memory the runtime may use (engine.gpu_memory_utilization)."""
    max_num_batched_tokens: int = 2048
    """Largest step in tokens (engine.max_num_batched_tokens): sizes the activations."""
    num_micro_batches: int | None = None
    """Decode micro-batches in flight with pp > 1; null means pp."""
    allow_cross_domain_tp: bool = False
    """Admit TP groups that span NVLink domains even when another layout fits."""
    simplicity_margin: float = 0.10
    """Prefer the simplest candidate within this fraction of the best score (about the
    cost model's error)."""
    max_dp: int | None = None
    """Largest data-parallel degree considered; null: any (the runtime serves dp=1)."""
    fill_cluster: bool = True
    """Use every device of the cluster (a launcher started that many ranks); false: any
    device count up to it, so a small model may stay on one device."""
    split_lm_head: bool = True
    """Pipelines of TP size 1 split the LM head between first and last stage
    (parallel.split_lm_head)."""
    simulate: bool = False
    """disagg=auto under a goodput objective: rank the finalists by simulated goodput
    (disagg_search.simulated_goodput) instead of the closed forms (plan.simulate)."""
    streamed_hop: bool = False
    """A split's decode replica reads each prompt's KV as its prefill steps compute it
    (disagg.stream_kv, prefill pp = 1), layer by layer: only the last layer of the last
    step's blocks moves after the first token."""

    def __post_init__(self) -> None:
        require(0 < self.memory_utilization <= 1, "plan.memory_utilization",
                self.memory_utilization, "a fraction in (0, 1]")
        require(self.max_num_batched_tokens >= 1, "plan.max_num_batched_tokens",
                self.max_num_batched_tokens, "an int >= 1")
        require(self.num_micro_batches is None or self.num_micro_batches >= 1,
                "plan.num_micro_batches", self.num_micro_batches, "null or an int >= 1")
        require(0 <= self.simplicity_margin < 1, "plan.simplicity_margin",
                self.simplicity_margin, "a fraction in [0, 1)")
        require(self.max_dp is None or self.max_dp >= 1, "plan.max_dp", self.max_dp,
                "null or an int >= 1")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One (tp, pp, dp) the planner weighed: its memory, predictions, or why it was rejected."""

    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline stages."""
    dp: int
    """Replicas."""
    stage_layers: tuple[tuple[int, int], ...] = ()
    """[start, end) layers per stage."""
    weight_gb: float = 0.0
    """Weights on the fullest device, GB."""
    activation_gb: float = 0.0
    """Activation workspace per device, GB."""
    kv_capacity_tokens: int = 0
    """Tokens of KV cache per replica."""
    prediction: Prediction | None = None
    """Predicted figures; null when rejected."""
    rejected: str | None = None
    """Why it can't run; null when accepted."""
    warning: str | None = None
    """A rule it breaks although accepted (TP across NVLink domains)."""

    @property
    def degrees(self) -> str:
        """'tp=8 pp=2 dp=1'."""
        return f"tp={self.tp} pp={self.pp} dp={self.dp}"


def gb(nbytes: float) -> str:
    """'141.1 GB' (three significant digits below 1 GB)."""
    return f"{nbytes / GB:.1f} GB" if nbytes >= GB else f"{nbytes / GB:.3g} GB"


def figure(x: float) -> str:
    """20,704 / 2,524 / 23.01: whole numbers from 100 up, three significant digits below."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def enumerate_degrees(num_devices: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) using all `num_devices`."""
    return [(tp, pp, num_devices // tp // pp) for tp in divisors(num_devices)
            for pp in divisors(num_devices // tp)]


def stage_ranges(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
                 tp: int, pp: int, split_lm_head: bool = False,
                 device_type: str | None = None) -> list[tuple[int, int]]:
    """Layers per stage balanced by what a typical request of the scenario costs each part:
    its prompt's prefill plus its share of output_len decode steps at the scenario's batch.

    Balancing by decode alone gives the last stage few layers when the LM head is large
    (the head runs for every decode token but for one row per prefill); a workload whose
    time goes mostly to prefill then leaves the first stage doing most of the work.
    `split_lm_head`: the head's cost is shared with stage 0 where head_first_fraction says
    so on `device_type` (default: the cluster's).
    """
    probe = CostModel(shape, cluster, layout_for(tp, [(0, shape.num_layers)], 1, cluster))
    prefill = StepWork.prefill(scenario.prompt_len)
    decode = StepWork.decode(scenario.max_batch, scenario.prompt_len + scenario.output_len / 2)
    steps = scenario.output_len / scenario.max_batch  # one sequence's share of decode steps

    def per_request(time_of: Callable[[StepWork], StageTime]) -> float:
        return time_of(prefill).total_s + steps * time_of(decode).total_s

    head, f = per_request(probe.head_time), head_first_fraction(
        split_lm_head, tp, pp, device_type or cluster.device_type)
    costs = StageCosts(layer=per_request(probe.layer_time), embed=per_request(probe.embed_time),
                       head=(1 - f) * head, head_first=f * head)
    return stage_layer_ranges(shape.num_layers, pp, costs)


def sized(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig, tp: int,
          pp: int, options: PlannerOptions) -> tuple[Candidate, CostModel | None]:
    """One replica of tp x pp checked against the rules: its memory, KV capacity and cost
    model, or why it can't run (then no cost model). A TP group across NVLink domains is
    accepted with a warning."""
    base = Candidate(tp=tp, pp=pp, dp=1)
    if err := shape.tp_error(tp):
        return replace(base, rejected=err), None
    if pp > shape.num_layers:
        return replace(base, rejected=f"pp={pp} > {shape.num_layers} layers"), None
    ranges = stage_ranges(shape, cluster, scenario, tp, pp, options.split_lm_head)
    m = options.num_micro_batches or pp
    cost = CostModel(shape, cluster, layout_for(
        tp, ranges, m, cluster, head_first_fraction(options.split_lm_head, tp, pp,
                                                cluster.device_type)))
    usable = cluster.device_memory_gb * GB * options.memory_utilization
    weights = max(cost.stage_weight_bytes(s) for s in range(pp))
    act = cost.activation_bytes(options.max_num_batched_tokens, scenario.max_batch)
    capacity = cost.kv_capacity_tokens(usable, act)
    cand = replace(base, stage_layers=tuple(ranges), weight_gb=weights / GB,
                   activation_gb=act / GB, kv_capacity_tokens=capacity)
    need = scenario.prompt_len + scenario.output_len
    if weights + act > usable:
        return replace(cand, rejected=(
            f"weights {gb(weights)} + activations {gb(act)} per device > {gb(usable)} usable "
            f"({cluster.device_memory_gb:g} GB x {options.memory_utilization:g})")), None
    if capacity < need:
        return replace(cand, rejected=f"KV cache holds {capacity} tokens < one request's "
                       f"{need}"), None
    if not tp_within_domain(tp, cluster):
        cand = replace(cand, warning=(
            f"TP={tp} over PCIe/network: the devices share no NVLink"
            if cluster.nvlink_domain_size == 1 else
            f"TP={tp} spans NVLink domains of {cluster.nvlink_domain_size} (runs over the "
            "slower link)"))
    return cand, cost


def evaluate(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
             degrees: tuple[int, int, int], options: PlannerOptions) -> Candidate:
    """Check one (tp, pp, dp) against the rules and predict its figures."""
    tp, pp, dp = degrees
    cand, cost = sized(shape, cluster, scenario, tp, pp, options)
    cand = replace(cand, dp=dp)
    if cost is None:
        return cand
    return replace(cand, prediction=predict(cost, scenario, dp=dp,
                                            kv_capacity_tokens=cand.kv_capacity_tokens,
                                            step_tokens=options.max_num_batched_tokens))


METRICS = {"latency": ("latency per request", "ms", False),
           "utilization": ("throughput", "tok/s", True),
           "throughput": ("goodput", "req/s", True),
           "ttft_throughput": ("goodput", "req/s", True)}
"""objective -> (first metric, unit, higher is better)."""


class Predicted(Protocol):
    """A layout with predicted figures (a Candidate, or a prefill/decode split)."""

    @property
    def prediction(self) -> Prediction | None: ...


def metric(c: Predicted, scenario: ScenarioConfig) -> float:
    """The scenario's first metric for an accepted candidate (latency for the latency
    objective; generated tokens/s for utilization; requests/s within both SLOs otherwise)."""
    p = c.prediction
    assert p is not None
    return {"latency": p.latency_ms, "utilization": p.throughput_tok_s}.get(
        scenario.objective, p.goodput_req_s)


def score(c: Predicted, scenario: ScenarioConfig) -> float:
    """Higher is better: the scenario's first metric, negated when lower is better."""
    return metric(c, scenario) if METRICS[scenario.objective][2] else -metric(c, scenario)


def rank(cands: list[Candidate], scenario: ScenarioConfig, margin: float) -> list[Candidate]:
    """SLO-meeting candidates first, by score; the simplest within `margin` of the best leads."""
    def key(c: Candidate) -> tuple[bool, float, int, int]:
        assert c.prediction is not None
        return (not c.prediction.meets_slo, -score(c, scenario), c.pp, c.tp)

    ordered = sorted(cands, key=key)
    if not ordered:
        return ordered
    best = ordered[0]
    top, meets = score(best, scenario), key(best)[0]
    close = [c for c in ordered
             if key(c)[0] == meets and score(c, scenario) >= top - margin * abs(top)]
    chosen = min(close, key=lambda c: (c.pp, c.tp))
    return [chosen] + [c for c in ordered if c is not chosen]


def plan(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
         options: PlannerOptions | None = None,
         degrees: tuple[int, int, int] | None = None) -> Plan:
    """The best plan for the scenario, or the plan of fixed `degrees` (tp, pp, dp)."""
    options = options or PlannerOptions()
    if degrees is not None:
        require(degrees[0] * degrees[1] * degrees[2] <= cluster.num_devices,
                "parallel.tp*pp*dp", degrees, f"at most {cluster.num_devices} devices ({cluster.name})")
    counts = [cluster.num_devices] if options.fill_cluster else range(1, cluster.num_devices + 1)
    space = [degrees] if degrees is not None else [
        d for n in counts for d in enumerate_degrees(n)
        if options.max_dp is None or d[2] <= options.max_dp]
    cands = [evaluate(shape, cluster, scenario, d, options) for d in space]
    ok = [c for c in cands if c.rejected is None and (
        c.warning is None or options.allow_cross_domain_tp or degrees is not None)]
    forced = False
    if not ok:
        ok = [c for c in cands if c.rejected is None]
        forced = bool(ok)
    if not ok:
        reasons = "; ".join(f"{c.degrees}: {c.rejected}" for c in cands)
        raise ValueError(f"model={shape.num_params / 1e9:.1f}B params on cluster={cluster.name}: "
                         f"no layout fits: {reasons}")
    ranked = rank(ok, scenario, options.simplicity_margin)
    turned_down = [c if c.rejected or c in ok else replace(
        c, rejected=f"{c.warning}; a layout inside the domains fits") for c in cands]
    best = ranked[0]
    warnings = tuple(w for w in (best.warning,) if w)
    if forced and warnings:
        warnings = (warnings[0] + ": forced, no layout inside the NVLink domains fits",)
    return Plan(tp=best.tp, pp=best.pp, dp=best.dp,
                num_micro_batches=(options.num_micro_batches or best.pp) if best.pp > 1 else 1,
                stage_layers=best.stage_layers,
                placements=place_ranks(best.tp, best.pp, best.dp, cluster), warnings=warnings,
                explanation=explain(ranked, turned_down, scenario, cluster),
                candidates=tuple(ranked) + tuple(c for c in turned_down if c not in ok))


def explain(ranked: list[Candidate], cands: list[Candidate], scenario: ScenarioConfig,
            cluster: ClusterConfig) -> str:
    """A few sentences on why the first of `ranked` won."""
    best = ranked[0]
    p = best.prediction
    assert p is not None
    name, unit, _ = METRICS[scenario.objective]
    load = (f"{scenario.max_batch} requests in flight" if scenario.objective == "latency"
            else f"batch {p.batch} per replica")
    lines = [f"Chose {best.degrees}: {scenario.name} ranks by {name} ({scenario.objective}); "
             f"at {load}: TTFT {p.ttft_ms:.1f} ms, TPOT {p.tpot_ms:.2f} ms, "
             f"{figure(p.throughput_tok_s)} tok/s; goodput {p.goodput_req_s:.2f} req/s"
             + ("." if p.meets_slo else " (misses the SLOs).")]
    if best.tp == 1:
        where = "No TP (no collectives)"
    elif tp_within_domain(best.tp, cluster):
        where = f"TP={best.tp} stays inside each {cluster.nvlink_domain_size}-device NVLink domain"
    else:
        where = f"TP={best.tp} crosses NVLink domains of {cluster.nvlink_domain_size}"
    lines.append(f"{where}; {best.pp} pipeline stage(s), {best.dp} replica(s) on "
                 f"{cluster.num_nodes} node(s) x {cluster.devices_per_node} "
                 f"{cluster.device_name or cluster.device_type}.")
    if len(ranked) > 1:
        nxt, top = ranked[1], metric(best, scenario)
        rel = (metric(nxt, scenario) - top) / top if top else 0.0
        simpler = score(nxt, scenario) > score(best, scenario)
        lines.append(f"Runner-up {nxt.degrees}: {name} {figure(metric(nxt, scenario))} {unit} "
                     f"({rel:+.1%})" + (", within the margin, so the simpler layout wins."
                                         if simpler else "."))
    rejected = [c for c in cands if c.rejected]
    if rejected:
        lines.append(f"Rejected {len(rejected)}, e.g. {rejected[0].degrees}: "
                     f"{rejected[0].rejected}.")
    return " ".join(lines)


def resolve_dtype(model_dtype: str, checkpoint_dtype: str, device_type: str) -> str:
    """The model dtype of a run: auto is the checkpoint's, but float32 on a CPU for
    anything other than bf16 (a bf16 model on a CPU holds bf16 weights and computes its
    activations in fp32 or bf16 per kernel)."""
    if model_dtype != "auto":
        return model_dtype
    if device_type == "cpu" and checkpoint_dtype != "bfloat16":
        return "float32"
    return checkpoint_dtype


def shape_for(config: RunLike, arch: ArchLike, device_type: str) -> ModelShape:
    """The cost model's view of a run's model: its compute dtype (resolve_dtype), its KV
    cache's (engine.kv_cache_dtype; auto: the model dtype) and, on a CPU, its weights'
    (model.cpu_weight_dtype; auto: the model dtype)."""
    dtype = resolve_dtype(config.model.dtype, getattr(arch, "dtype", "bfloat16"), device_type)
    kv = config.engine.kv_cache_dtype
    weights = config.model.cpu_weight_dtype
    return ModelShape.from_arch(arch, dtype, None if kv == "auto" else kv,
                                weights if device_type == "cpu" and weights != "auto"
                                else None)


def options_for(config: RunLike) -> PlannerOptions:
    """Planner options from a run's engine and parallel settings."""
    return PlannerOptions(memory_utilization=config.engine.gpu_memory_utilization,
                          max_num_batched_tokens=config.engine.step_token_cap,
                          num_micro_batches=config.parallel.num_micro_batches,
                          split_lm_head=config.parallel.split_lm_head,
                          streamed_hop=streams_kv(config))


def streams_kv(config: RunLike) -> bool:
    """Whether a split of this run reads prompts' KV as it is computed (disagg.stream_kv)."""
    d = getattr(config, "disagg", None)
    return d is not None and bool(d.stream_kv)


def is_auto(config: RunLike) -> bool:
    """Whether the run asks the planner for its degrees (parallel=auto)."""
    return bool(getattr(config.parallel, "auto", False))


def plan_for(config: RunLike, arch: ArchLike, *, max_dp: int | None = None,
             fill_cluster: bool = True) -> Plan:
    """The Plan a run starts with: the planner's choice under parallel=auto (at most
    `max_dp` replicas; on every device of the cluster or, without `fill_cluster`, on as
    many as pay), else the configured degrees checked and placed. `arch` is the model's
    ModelArch."""
    shape = shape_for(config, arch, config.cluster.device_type)
    par = config.parallel
    degrees = None if is_auto(config) else (par.tp, par.pp, par.dp)
    options = replace(options_for(config), max_dp=max_dp, fill_cluster=fill_cluster)
    return plan(shape, config.cluster, config.scenario, options, degrees)


def lm_head_split(config: RunLike, vocab_size: int, device_type: str) -> int | None:
    """With parallel.split_lm_head, a CPU pipeline (pp > 1) of TP size 1 gives its first
    stage the LM head's vocabulary rows [0, this) and the last stage the rest; else None."""
    p = config.parallel
    f = head_first_fraction(p.split_lm_head, p.tp, p.pp, device_type)
    return int(vocab_size * f) if f else None


def runtime_stage_ranges(config: RunLike, arch: ArchLike, tp: int, pp: int,
                         device_type: str | None = None) -> list[tuple[int, int]]:
    """The layer ranges a running tp x pp layout uses: the ones the planner predicts it with
    (stage_ranges) for the run's cluster and scenario. A cluster preset with fewer devices
    than the tp ranks is taken as having enough nodes of its kind. `arch`: a ModelArch."""
    cluster = config.cluster
    if cluster.num_devices < tp:
        cluster = replace(cluster, num_nodes=-(-tp // cluster.devices_per_node))
    return stage_ranges(shape_for(config, arch, cluster.device_type), cluster, config.scenario, tp, pp,
                        config.parallel.split_lm_head, device_type)
