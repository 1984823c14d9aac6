"""Where a workload's step time went, by cause, against the cost model; the bottleneck and
what to do about it.

Each step's executor time (wall minus scheduler) is split with the cost model's prediction
for the same work: the roofline time of its prefill chunks (compute-bound) and of its decodes
(memory-bound on GPUs; on a CPU already compute-bound from a batch of ~3), in proportion to
what each phase would cost alone; TP collectives (measured when the record has them);
pipeline bubbles; what the roofline doesn't explain (launches, Python per layer, a stale
calibration) is "other", except the share of it the pipeline's idle stages spend waiting
(the predicted bubble fraction of the step), which counts as bubbles. When a step ran
faster than predicted, the predicted parts are scaled down to the measured time.

A pipelined run (pp > 1) records one micro-batch per step with the number in flight: its
prediction is its share of a pipeline round of that many, so a lone micro-batch crossing
every stage shows its bubble.

What is measured and what is modelled (`Diagnosis.sources`): the scheduler's time is
measured; communication is measured where the records carry it (gloo collectives' wall
time on CPU), else modelled; pipeline bubbles are measured where the records carry the
ranks' stage times (each stage's waits for its input, `measured_bubble_s`), else modelled;
the split of the rest between prefill and decode is the cost model's attribution of the
measured executor time, and "other" is what is left.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

from meshserve.parallel.planner.budget_report import StepBudgetReport, step_budget_report
from meshserve.parallel.planner.cost_model import CostModel, StepCost, StepWork
from meshserve.validation import require

MEASURED, MODELLED, RESIDUAL = "measured", "modelled", "residual"
"""Where a cause's seconds come from."""

CAUSES = ("prefill_compute", "decode_memory", "communication", "pipeline_bubbles", "scheduler",
          "other")

STRATEGIES = {
    "prefill_compute": "prefill is compute-bound: raise prefix-cache hits (shared system "
                       "prompts), chunk long prompts so decodes keep flowing, more TP for TTFT, "
                       "or disaggregate prefill onto its own workers",
    "decode_memory": "decode re-reads the weights and KV every step: put more sequences in each "
                     "step (continuous batching, larger engine.max_num_seqs), speculative "
                     "decoding while batches are small, or more TP to split the weight reads",
    "communication": "collectives dominate: keep TP inside an NVLink domain, trade TP for PP "
                     "across nodes or for DP replicas, or carry more tokens per AllReduce",
    "pipeline_bubbles": "stages wait on each other: keep num_micro_batches >= pp with enough "
                        "sequences in flight, rebalance the stage layer ranges, or use fewer stages",
    "scheduler": "the scheduler's Python is on the critical path: more tokens per step, overlap "
                 "scheduling with execution, fewer sequences rescanned per step",
    "other": "time the roofline does not explain (kernel launches, Python per layer, syncs): "
             "CUDA graphs for decode, fused kernels; or recalibrate with `meshserve calibrate`",
}

SCENARIO_LEVERS = {  # the scenario table of docs/architecture.md
    "chatbot": "small batches, speculative decoding, prefix caching",
    "codegen": "continuous batching, large batches, TP",
    "offline": "largest batch, least TP, consider disaggregation",
    "rag": "prefix caching, medium batches",
}


COUNT_FIELDS = ("num_prefill_tokens", "num_prefill_seqs", "num_prefill_cached_tokens",
                "num_decode_seqs", "num_decode_context_tokens")
"""StepRecord's work counts, in chunk_counts' order."""


def chunk_counts(chunks: Iterable[tuple[int, int]]) -> tuple[int, int, int, int, int]:
    """COUNT_FIELDS of a step's (num_tokens, start_pos) per scheduled sequence: one token is
    a decode reading start_pos cached tokens, more is a prefill chunk after start_pos cached
    ones."""
    prefill_tokens = prefill_seqs = prefill_cached = decode_seqs = decode_context = 0
    for num_tokens, start_pos in chunks:
        if num_tokens == 1:
            decode_seqs += 1
            decode_context += start_pos
        else:
            prefill_tokens += num_tokens
            prefill_seqs += 1
            prefill_cached += start_pos
    return prefill_tokens, prefill_seqs, prefill_cached, decode_seqs, decode_context


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one engine step did and how long it took."""

    num_prefill_tokens: int = 0
    """Prompt tokens computed (prefix-cache hits excluded)."""
    num_prefill_seqs: int = 0
    """Sequences with a prefill chunk in the step."""
    num_prefill_cached_tokens: int = 0
    """Tokens those chunks attend to from the cache (prefix hits, earlier chunks)."""
    num_decode_seqs: int = 0
    """Sequences decoding one token each."""
    num_decode_context_tokens: int = 0
    """KV tokens the decoding sequences read (the sum of their contexts)."""
    wall_s: float
    """The step's wall time: schedule, execute, update."""
    scheduler_s: float = 0.0
    """Of which the scheduler's own work."""
    comm_s: float | None = None
    """Of which communication, when the executor measures it."""
    num_in_flight: int | None = None
    """Pipelined runs (pp > 1): micro-batches in the pipeline when this one finished; the
    record is then one micro-batch and its wall time its share of a pipeline round. Null:
    the record is a whole round of the layout's micro-batches."""
    num_draft_tokens: int = 0
    """Speculative decoding: drafted tokens the decodes verified (beyond their one each)."""
    num_accepted_tokens: int = 0
    """Of which accepted: output tokens the step gave beyond one per decode."""
    token_budget: int | None = None
    """The tokens an automatic step budget allowed the step (engine.max_num_batched_tokens
    auto); null: the fixed budget."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            require(v is None or v >= 0, f"step.{f.name}", v, "a number >= 0")
        require(self.num_in_flight is None or self.num_in_flight >= 1, "step.num_in_flight",
                self.num_in_flight, "null or an int >= 1")
        require(self.scheduler_s <= self.wall_s, "step.scheduler_s", self.scheduler_s,
                f"at most wall_s={self.wall_s}")
        require((self.num_prefill_tokens > 0) == (self.num_prefill_seqs > 0),
                "step.num_prefill_seqs", self.num_prefill_seqs,
                "> 0 exactly when num_prefill_tokens > 0")

    @classmethod
    def from_chunks(cls, chunks: Iterable[tuple[int, int]], *, wall_s: float,
                    scheduler_s: float = 0.0, comm_s: float | None = None,
                    num_in_flight: int | None = None, num_draft_tokens: int = 0,
                    num_accepted_tokens: int = 0, token_budget: int | None = None
                    ) -> StepRecord:
        """From a step's (num_tokens, start_pos) per scheduled sequence (see chunk_counts;
        a decode's drafts not counted in its num_tokens)."""
        return cls(**dict(zip(COUNT_FIELDS, chunk_counts(chunks))), wall_s=wall_s,
                   scheduler_s=scheduler_s, comm_s=comm_s, num_in_flight=num_in_flight,
                   num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted_tokens,
                   token_budget=token_budget)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode_seqs > 0 and self.num_prefill_seqs == 0

    def decode_work(self) -> StepWork:
        """The step's decodes as cost-model work."""
        return StepWork.decode(self.num_decode_seqs, 0) + StepWork(
            num_kv_read=self.num_decode_context_tokens,
            num_attended=self.num_decode_context_tokens)

    def prefill_work(self) -> StepWork:
        """The step's prefill chunks as cost-model work (taken as equal in length)."""
        s = self.num_prefill_seqs
        if not s:
            return StepWork()
        return StepWork.prefill(self.num_prefill_tokens / s, self.num_prefill_cached_tokens / s, s)

    def work(self) -> StepWork:
        """The whole step as cost-model work."""
        return self.decode_work() + self.prefill_work()


@dataclass(frozen=True, kw_only=True)
class Speculation:
    """How much speculative decoding ran, and whether it paid."""

    num_drafted_steps: int
    """Steps whose decodes carried drafts."""
    num_decode_steps: int
    """Decode-only steps, drafted or not."""
    num_draft_tokens: int
    num_accepted_tokens: int
    tokens_per_decode: float
    """Output tokens per decoding sequence in drafted decode-only steps (1 + accepted)."""
    speedup: float | None
    """Drafted decode-only steps' tokens per second over plain ones' at the same batch size
    (power-of-two buckets with both kinds, weighted by the drafted steps' time); None
    where no bucket has both."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def verdict(self) -> str:
        if self.speedup is None:
            return ("not measured: no plain decode steps at the batch sizes that drafted "
                    "(speculative.max_batch_size or the run-time switch decides which)")
        if self.speedup >= 1.0:
            return f"paid: drafted decode steps delivered {self.speedup:.2f}x the tokens/s"
        return (f"did not pay: drafted decode steps delivered {self.speedup:.2f}x the tokens/s"
                " of plain ones; a lower speculative.num_tokens or max_batch_size may")


def speculation(records: Iterable[StepRecord]) -> Speculation | None:
    """The speculation summary of a run's records; None if no step drafted."""
    drafted: dict[int, list[float]] = {}  # bucket -> [tokens, seconds]
    plain: dict[int, list[float]] = {}
    num_drafted = num_decode = drafts = accepted = 0
    decode_seqs = 0
    for r in records:
        if r.num_draft_tokens:
            num_drafted += 1
            drafts += r.num_draft_tokens
            accepted += r.num_accepted_tokens
        if not r.is_decode_only:
            continue
        num_decode += 1
        side = drafted if r.num_draft_tokens else plain
        acc = side.setdefault(r.num_decode_seqs.bit_length(), [0.0, 0.0])
        acc[0] += r.num_decode_seqs + r.num_accepted_tokens
        acc[1] += r.wall_s
        if r.num_draft_tokens:
            decode_seqs += r.num_decode_seqs
    if not num_drafted:
        return None
    both = [b for b in drafted if b in plain and plain[b][1] > 0 and drafted[b][1] > 0]
    speedup = None
    if both:  # the time the drafted steps' tokens would have taken at the plain rate
        at_plain = sum(drafted[b][0] * plain[b][1] / plain[b][0] for b in both)
        speedup = at_plain / sum(drafted[b][1] for b in both)
    tokens = sum(v[0] for v in drafted.values())
    return Speculation(num_drafted_steps=num_drafted, num_decode_steps=num_decode,
                       num_draft_tokens=drafts, num_accepted_tokens=accepted,
                       tokens_per_decode=tokens / decode_seqs if decode_seqs else 0.0,
                       speedup=speedup)


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """Time by cause over all steps, the bottleneck and the strategy for it."""

    seconds: dict[str, float]
    """Seconds per cause (CAUSES), summing to the total wall time."""
    total_s: float
    """Wall time of all steps."""
    predicted_s: float
    """The cost model's executor time for the same steps."""
    num_steps: int
    """Steps read."""
    bottleneck: str
    """The cause with the most time."""
    strategy: str
    """What to do about it."""
    speculation: Speculation | None = None
    """Speculative decoding's share and payoff, where any step drafted."""
    step_budget: StepBudgetReport | None = None
    """The automatic step budget's choices and the decode steps' times, where it ran."""
    sources: dict[str, str] = field(default_factory=dict)
    """Per cause, MEASURED, MODELLED or RESIDUAL (see the module's docstring)."""

    @property
    def shares(self) -> dict[str, float]:
        """Fraction of the wall time per cause."""
        return {k: v / self.total_s if self.total_s else 0.0 for k, v in self.seconds.items()}

    @property
    def model_accuracy(self) -> float:
        """Predicted / measured executor time (1.0: the cost model is exact)."""
        measured = self.total_s - self.seconds["scheduler"]
        return self.predicted_s / measured if measured else float("nan")

    def as_dict(self) -> dict[str, object]:
        """For JSON."""
        out = {**asdict(self), "shares": self.shares, "model_accuracy": self.model_accuracy}
        if self.speculation is not None:
            out["speculation"] = {**asdict(self.speculation),
                                  "acceptance_rate": self.speculation.acceptance_rate,
                                  "verdict": self.speculation.verdict}
        if self.step_budget is not None:
            out["step_budget"] = {**asdict(self.step_budget),
                                  "text": self.step_budget.describe()}
        return out


def record_cost(cost: CostModel, work: StepWork, num_in_flight: int | None) -> StepCost:
    """The predicted cost of a record's work: a whole round (num_in_flight None), or one
    micro-batch's share of a round of num_in_flight like it (its bubble included)."""
    if num_in_flight is None:
        return cost.step(work)
    k = num_in_flight
    c = cost.step(work.scaled(k), k)
    return StepCost(**{f.name: getattr(c, f.name) / k for f in fields(StepCost)})


def split_step(record: StepRecord, cost: CostModel) -> tuple[dict[str, float], float]:
    """One step's seconds per cause, and the cost model's prediction of its executor time."""
    k = record.num_in_flight
    c = record_cost(cost, record.work(), k)
    executor = record.wall_s - record.scheduler_s
    alone = [record_cost(cost, w, k) if w.num_seqs else None
             for w in (record.prefill_work(), record.decode_work())]
    prefill, decode = (a.compute_s + a.memory_s if a else 0.0 for a in alone)
    share = prefill / (prefill + decode) if prefill + decode else 0.0
    roofline = c.compute_s + c.memory_s
    parts = {"prefill_compute": roofline * share, "decode_memory": roofline * (1 - share),
             "communication": c.comm_s, "pipeline_bubbles": c.bubble_s, "other": c.overhead_s}
    if record.comm_s is not None:
        parts["communication"] = min(record.comm_s, executor)
    predicted = sum(parts.values())
    if predicted > executor:  # faster than predicted: shrink the modelled parts to fit
        fixed = parts["communication"] if record.comm_s is not None else 0.0
        scale = (executor - fixed) / (predicted - fixed) if predicted > fixed else 0.0
        parts = {k: v if (k == "communication" and record.comm_s is not None) else v * scale
                 for k, v in parts.items()}
    else:  # unmodelled work stretches every stage, and idle stages wait on it alike
        idle = c.bubble_s / c.total_s if c.total_s else 0.0
        parts["pipeline_bubbles"] += (executor - predicted) * idle
        parts["other"] += (executor - predicted) * (1 - idle)
    return {**parts, "scheduler": record.scheduler_s}, c.total_s


def measured_bubble_s(first: Sequence[Mapping[str, float]], last: Sequence[Mapping[str, float]],
                      scheduler_s: float) -> float:
    """A pipeline's bubbles between two snapshots of its ranks' stage times (StageStats'
    fields): per stage, its first TP rank's waits for its input (stage 0's: for the last
    stage's tokens), the later stages' less `scheduler_s` (they wait through the
    scheduler too, which is its own cause), averaged over the stages."""
    before = {(r["pp_rank"], r["tp_rank"]): r for r in first}
    waits = []
    for r in last:
        b = before.get((r["pp_rank"], r["tp_rank"]))
        if r["tp_rank"] != 0 or b is None:
            continue
        wait = r["input_wait_s"] - b["input_wait_s"] - (scheduler_s if r["pp_rank"] else 0.0)
        waits.append(max(wait, 0.0))
    return sum(waits) / len(waits) if waits else 0.0


def diagnose(records: Iterable[StepRecord], cost: CostModel,
             scenario: str | None = None, tpot_target_s: float | None = None,
             bubble_s: float | None = None) -> Diagnosis:
    """Split the steps' time by cause; name the bottleneck and the strategy for it
    (`tpot_target_s`: what an automatic step budget kept decode steps within; `bubble_s`:
    the pipeline bubbles measured over the records, in place of the modelled ones)."""
    seconds = dict.fromkeys(CAUSES, 0.0)
    total = predicted = 0.0
    n = 0
    records = list(records)
    for r in records:
        parts, pred = split_step(r, cost)
        for k, v in parts.items():
            seconds[k] += v
        total += r.wall_s
        predicted += pred
        n += 1
    require(n > 0, "diagnose.records", n, "at least one step record")
    if bubble_s is not None:
        _use_measured_bubbles(seconds, total, bubble_s)
    sources = {"prefill_compute": MODELLED, "decode_memory": MODELLED,
               "communication": MEASURED if any(r.comm_s is not None for r in records)
               else MODELLED,
               "pipeline_bubbles": MEASURED if bubble_s is not None else MODELLED,
               "scheduler": MEASURED, "other": RESIDUAL}
    bottleneck = max(CAUSES, key=lambda k: seconds[k])
    strategy = STRATEGIES[bottleneck]
    if scenario in SCENARIO_LEVERS:
        strategy += f"; for {scenario} the usual levers are {SCENARIO_LEVERS[scenario]}"
    return Diagnosis(seconds=seconds, total_s=total, predicted_s=predicted, num_steps=n,
                     bottleneck=bottleneck, strategy=strategy, speculation=speculation(records),
                     step_budget=step_budget_report(records, tpot_target_s), sources=sources)


def _use_measured_bubbles(seconds: dict[str, float], total: float, bubble_s: float) -> None:
    """Put the measured bubbles in place of the modelled ones: the difference goes to
    "other", and where "other" cannot give it, out of the roofline parts."""
    executor = total - seconds["scheduler"]
    measured = min(bubble_s, max(executor - seconds["communication"], 0.0))
    seconds["other"] += seconds["pipeline_bubbles"] - measured
    seconds["pipeline_bubbles"] = measured
    if seconds["other"] < 0:
        deficit, seconds["other"] = -seconds["other"], 0.0
        roof = seconds["prefill_compute"] + seconds["decode_memory"]
        scale = max(roof - deficit, 0.0) / roof if roof else 0.0
        seconds["prefill_compute"] *= scale
        seconds["decode_memory"] *= scale
