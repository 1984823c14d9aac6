"""diagnose: step time split by cause against the cost model, bottleneck and strategy."""

from __future__ import annotations

import pytest

from meshserve.launch.cli_config import load_config
from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.cost_model import CostModel, Layout, StepWork
from meshserve.parallel.planner.diagnosis import (
    CAUSES,
    StepRecord,
    diagnose,
    speculation,
    split_step,
)
from meshserve.parallel.planner.model_shape import ModelShape

CFG = load_config(["model=llama-3-8b", "cluster=dgx-h100"])
SHAPE = ModelShape.from_arch(ModelArch.from_hf_dict(CFG.model.arch), "bfloat16")
H100 = CFG.cluster


def model(tp: int = 1, stages: tuple[int, ...] = (32,), micro: int = 1) -> CostModel:
    links = ("intra",) * (len(stages) - 1)
    return CostModel(SHAPE, H100, Layout(tp=tp, stage_layers=stages, stage_links=links,
                                         num_micro_batches=micro))


def decode_record(cost: CostModel, batch: int, context: int, slowdown: float = 1.0,
                  **kw: float) -> StepRecord:
    wall = cost.step(StepWork.decode(batch, context)).total_s * slowdown + kw.get("scheduler_s", 0)
    return StepRecord(num_decode_seqs=batch, num_decode_context_tokens=batch * context,
                      wall_s=wall, **kw)


def test_decode_at_its_roofline_is_memory_bound() -> None:
    cost = model()
    d = diagnose([decode_record(cost, 8, 1000)] * 10, cost)
    expect = cost.step(StepWork.decode(8, 1000))
    assert d.bottleneck == "decode_memory" and d.num_steps == 10
    assert d.seconds["decode_memory"] == pytest.approx(10 * expect.memory_s)
    assert d.seconds["other"] == pytest.approx(0.0, abs=1e-12)
    assert d.model_accuracy == pytest.approx(1.0)
    assert sum(d.seconds.values()) == pytest.approx(d.total_s)
    assert d.strategy.startswith("decode re-reads the weights")


def test_long_prompts_are_prefill_compute() -> None:
    cost = model()
    work = StepWork.prefill(1024, 0, 2)
    rec = StepRecord(num_prefill_tokens=2048, num_prefill_seqs=2, wall_s=cost.step(work).total_s)
    d = diagnose([rec], cost, scenario="rag")
    assert d.bottleneck == "prefill_compute"
    assert d.shares["prefill_compute"] == pytest.approx(1.0)  # its LM-head read included
    assert d.strategy.endswith("for rag the usual levers are prefix caching, medium batches")


def test_time_the_roofline_cannot_explain_is_other() -> None:
    cost = model()
    d = diagnose([decode_record(cost, 1, 100, slowdown=3.0)], cost)
    assert d.bottleneck == "other"
    assert d.shares["other"] == pytest.approx(2 / 3)
    assert d.model_accuracy == pytest.approx(1 / 3)


def test_faster_than_predicted_scales_the_parts_down() -> None:
    cost = model()
    parts, predicted = split_step(decode_record(cost, 8, 1000, slowdown=0.5), cost)
    assert sum(parts.values()) == pytest.approx(predicted / 2)
    assert parts["other"] == 0.0


def test_measured_communication_counts_as_is() -> None:
    cost = model(tp=8)
    base = cost.step(StepWork.decode(1, 100)).total_s
    rec = StepRecord(num_decode_seqs=1, num_decode_context_tokens=100, wall_s=4 * base,
                     comm_s=3 * base)
    parts, _ = split_step(rec, cost)
    assert parts["communication"] == pytest.approx(3 * base)
    assert diagnose([rec], cost).bottleneck == "communication"


def test_one_micro_batch_over_four_stages_is_mostly_bubble() -> None:
    cost = model(stages=(8, 8, 8, 8), micro=1)
    d = diagnose([decode_record(cost, 64, 500)], cost)
    assert d.bottleneck == "pipeline_bubbles"
    assert d.shares["pipeline_bubbles"] == pytest.approx(0.75, abs=0.03)


def test_scheduler_overhead() -> None:
    cost = model()
    step = cost.step(StepWork.decode(4, 10)).total_s
    d = diagnose([decode_record(cost, 4, 10, scheduler_s=2 * step)], cost)
    assert d.bottleneck == "scheduler" and d.seconds["scheduler"] == pytest.approx(2 * step)
    assert set(d.as_dict()["seconds"]) == set(CAUSES)


def test_bad_records_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"step.scheduler_s=2.0 is invalid: allowed is at most "
                                         r"wall_s=1.0"):
        StepRecord(wall_s=1.0, scheduler_s=2.0)
    with pytest.raises(ValueError, match=r"step.num_prefill_seqs=0 is invalid"):
        StepRecord(num_prefill_tokens=5, wall_s=1.0)
    with pytest.raises(ValueError, match=r"diagnose.records=0 is invalid"):
        diagnose([], model())


def test_record_from_scheduled_chunks() -> None:
    rec = StepRecord.from_chunks([(1, 40), (1, 17), (64, 0), (32, 128)], wall_s=0.02,
                                 scheduler_s=0.001)
    assert (rec.num_decode_seqs, rec.num_decode_context_tokens) == (2, 57)
    assert (rec.num_prefill_tokens, rec.num_prefill_seqs, rec.num_prefill_cached_tokens) == (
        96, 2, 128)
    work = rec.work()
    assert (work.num_new_tokens, work.num_seqs, work.num_kv_read) == (98, 4, 57 + 128)
    # Prefill chunks taken as two of 48 tokens after 64 cached: 2 x (48 x 64 + 48 x 49 / 2).
    assert work.num_attended == 57 + 2 + 2 * (48 * 64 + 48 * 49 / 2)


def test_cpu_decode_is_compute_bound_yet_counted_as_decode() -> None:
    cpu = load_config(["cluster=local-cpu"]).cluster
    cost = CostModel(ModelShape.from_arch(ModelArch.from_hf_dict(CFG.model.arch), "float32"),
                     cpu, Layout(tp=1, stage_layers=(32,)))
    step = cost.step(StepWork.decode(8, 100))
    assert step.compute_s > 0 and step.memory_s < step.compute_s / 10  # past the CPU's ridge
    mixed = StepRecord(num_decode_seqs=8, num_decode_context_tokens=800, num_prefill_tokens=64,
                       num_prefill_seqs=1, wall_s=100.0)  # slower than predicted: no scaling
    parts, _ = split_step(mixed, cost)
    alone_p = cost.step(mixed.prefill_work())
    alone_d = cost.step(mixed.decode_work())
    share = (alone_p.compute_s + alone_p.memory_s) / (
        alone_p.compute_s + alone_p.memory_s + alone_d.compute_s + alone_d.memory_s)
    both = cost.step(mixed.work())
    assert parts["prefill_compute"] == pytest.approx((both.compute_s + both.memory_s) * share)
    assert parts["decode_memory"] == pytest.approx((both.compute_s + both.memory_s) * (1 - share))


def test_a_lone_micro_batch_record_shows_its_bubble() -> None:
    # pp=4, one micro-batch in flight: it crosses every stage while three idle.
    cost = model(stages=(8, 8, 8, 8), micro=4)
    alone = cost.step(StepWork.decode(16, 500), 1)
    rec = StepRecord(num_decode_seqs=16, num_decode_context_tokens=16 * 500,
                     wall_s=alone.total_s, num_in_flight=1)
    parts, predicted = split_step(rec, cost)
    assert predicted == pytest.approx(alone.total_s)
    assert parts["pipeline_bubbles"] == pytest.approx(alone.bubble_s)
    assert alone.bubble_s == pytest.approx(0.75 * alone.total_s, abs=0.03 * alone.total_s)
    assert diagnose([rec], cost).bottleneck == "pipeline_bubbles"


def test_a_full_pipeline_record_is_its_share_of_a_round() -> None:
    cost = model(stages=(8, 8, 8, 8), micro=4)
    work = StepWork.decode(16, 500)
    round_ = cost.step(work.scaled(4), 4)  # four such micro-batches advance once each
    rec = StepRecord(num_decode_seqs=16, num_decode_context_tokens=16 * 500,
                     wall_s=round_.total_s / 4, num_in_flight=4)
    parts, predicted = split_step(rec, cost)
    assert predicted == pytest.approx(round_.total_s / 4)
    assert parts["pipeline_bubbles"] == pytest.approx(round_.bubble_s / 4)
    assert parts["pipeline_bubbles"] < 0.2 * rec.wall_s  # the head's stage is the slowest


def test_unexplained_time_in_a_pipeline_waits_in_its_bubbles() -> None:
    cost = model(stages=(16, 16), micro=2)
    alone = cost.step(StepWork.decode(8, 100), 1)
    rec = StepRecord(num_decode_seqs=8, num_decode_context_tokens=800,
                     wall_s=3 * alone.total_s, num_in_flight=1)
    parts, _ = split_step(rec, cost)
    idle = alone.bubble_s / alone.total_s
    assert parts["pipeline_bubbles"] == pytest.approx(3 * alone.bubble_s)
    assert parts["other"] == pytest.approx(2 * alone.total_s * (1 - idle) + alone.overhead_s)
    assert sum(parts.values()) == pytest.approx(rec.wall_s)


def test_num_in_flight_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"step.num_in_flight=0 is invalid: allowed is null or "
                                         r"an int >= 1"):
        StepRecord(wall_s=1.0, num_in_flight=0)


def test_speculation_summary_prices_drafted_steps_against_plain_ones_at_their_batch() -> None:
    def decode(n: int, wall: float, drafts: int = 0, accepted: int = 0) -> StepRecord:
        return StepRecord(num_decode_seqs=n, num_decode_context_tokens=100 * n, wall_s=wall,
                          num_draft_tokens=drafts, num_accepted_tokens=accepted)

    prefill = StepRecord(num_prefill_tokens=50, num_prefill_seqs=1, wall_s=0.02)
    # batch 1: plain 1 token / 4 ms; drafted 3 tokens / 8 ms -> 1.5x. Batch 8 plain only.
    records = [prefill, *[decode(1, 0.004)] * 4, *[decode(1, 0.008, 4, 2)] * 6,
               *[decode(8, 0.01)] * 3]
    s = speculation(records)
    assert s is not None
    assert (s.num_drafted_steps, s.num_decode_steps) == (6, 13)
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (24, 12)
    assert s.acceptance_rate == 0.5 and s.tokens_per_decode == 3.0
    assert s.speedup == pytest.approx(1.5) and s.verdict.startswith("paid")
    lonely = speculation([decode(1, 0.008, 4, 0)])  # nothing plain to compare with
    assert lonely is not None and lonely.speedup is None and "not measured" in lonely.verdict
    assert speculation([prefill, decode(1, 0.004)]) is None


def stage(pp_rank: int, wait: float, tp_rank: int = 0) -> dict[str, float]:
    return {"rank": 2 * pp_rank + tp_rank, "pp_rank": pp_rank, "tp_rank": tp_rank,
            "busy_s": 0.0, "input_wait_s": wait, "num_micro_batches": 0}


def test_measured_bubbles_are_each_stages_waits_averaged() -> None:
    """Stage 0 waited 3 s for tokens, stage 1 5 s for activations, 1 s of which the
    scheduler ran (its own cause); other TP ranks of a stage are not read."""
    from meshserve.parallel.planner.diagnosis import measured_bubble_s

    first = [stage(0, 1.0), stage(1, 2.0), stage(1, 0.0, tp_rank=1)]
    last = [stage(0, 4.0), stage(1, 7.0), stage(1, 99.0, tp_rank=1)]
    assert measured_bubble_s(first, last, scheduler_s=1.0) == pytest.approx((3 + 4) / 2)


def test_measured_bubbles_replace_the_modelled_ones_and_say_so() -> None:
    cost = model(stages=(16, 16), micro=1)
    rec = decode_record(cost, 4, 500, slowdown=2.0, num_in_flight=1)
    modelled = diagnose([rec], cost)
    assert modelled.sources["pipeline_bubbles"] == "modelled"
    measured = diagnose([rec], cost, bubble_s=rec.wall_s / 2)
    assert measured.sources["pipeline_bubbles"] == "measured"
    assert measured.sources["scheduler"] == "measured" and measured.sources["other"] == "residual"
    assert measured.seconds["pipeline_bubbles"] == pytest.approx(rec.wall_s / 2)
    assert sum(measured.seconds.values()) == pytest.approx(rec.wall_s)
    assert all(v >= 0 for v in measured.seconds.values())
    # more bubble than the modelled parts leave room for: the roofline parts give way
    most = diagnose([rec], cost, bubble_s=rec.wall_s * 0.99)
    assert most.seconds["other"] == 0.0
    assert sum(most.seconds.values()) == pytest.approx(rec.wall_s)
