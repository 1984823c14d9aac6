"""The sampler's logit_bias, presence, frequency and repetition penalties and min_p against
values worked out by hand on a six-token vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from meshserve.engine.core.sampling_params import SamplingParams, SequenceSampling
from meshserve.engine.worker.sampling.logit_adjuster import LogitAdjuster
from meshserve.engine.worker.sampling.sampler import Sampler
from meshserve.engine.worker.sampling.step_sampler import StepSampler

CPU = torch.device("cpu")
ROW = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]


def adjuster_with(seqs: dict[int, SequenceSampling]) -> LogitAdjuster:
    adj = LogitAdjuster(6, CPU)
    for seq_id, seq in seqs.items():
        adj.track(seq_id, seq)
    return adj


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    p = SamplingParams(logit_bias={1: 5.0, 4: -100.0})
    plain = SamplingParams()
    adj = adjuster_with({0: SequenceSampling(p), 1: SequenceSampling(plain)})
    logits = torch.tensor([ROW, ROW])
    out = adj.apply(logits, [0, 1], [p, plain])
    assert out[0].tolist() == [2.0, 4.0, 0.5, 3.0, -102.0, 0.0]
    assert out[1].tolist() == ROW
    assert logits[0].tolist() == ROW  # raw logits (for logprobs) untouched


def test_presence_and_frequency_penalties_count_generated_tokens() -> None:
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    adj = adjuster_with({7: SequenceSampling(p)})
    for token in (3, 3, 0):  # generated so far: token 3 twice, token 0 once
        adj.record([7], [p], torch.tensor([token]))
    out = adj.apply(torch.tensor([ROW]), [7], [p])[0].tolist()
    # token 3: 3.0 - 0.25 * 2 - 0.5; token 0: 2.0 - 0.25 - 0.5; the rest unchanged.
    assert out == pytest.approx([1.25, -1.0, 0.5, 2.0, -2.0, 0.0])


def test_repetition_penalty_reads_prompt_and_output() -> None:
    p = SamplingParams(repetition_penalty=2.0)
    adj = adjuster_with({0: SequenceSampling(p, prompt_token_ids=(0, 1))})
    adj.record([0], [p], torch.tensor([4]))
    out = adj.apply(torch.tensor([ROW]), [0], [p])[0].tolist()
    # prompt tokens 0 (2.0 -> 1.0) and 1 (-1.0 -> -2.0), output token 4 (-2.0 -> -4.0).
    assert out == pytest.approx([1.0, -2.0, 0.5, 3.0, -4.0, 0.0])


def test_forgotten_rows_are_reused_clean_and_the_slab_grows() -> None:
    p = SamplingParams(frequency_penalty=1.0)
    adj = LogitAdjuster(6, CPU)
    for seq_id in range(20):  # past the first slab of 8 rows
        adj.track(seq_id, SequenceSampling(p))
        adj.record([seq_id], [p], torch.tensor([seq_id % 6]))
    assert adj.history.counts.shape[0] == 32
    adj.forget(3)
    adj.track(99, SequenceSampling(p))
    out = adj.apply(torch.tensor([ROW, ROW]), [99, 4], [p, p])
    assert out[0].tolist() == ROW  # row 3's counts did not leak into its successor
    assert out[1].tolist() == pytest.approx([2.0, -1.0, 0.5, 3.0, -3.0, 0.0])


def test_step_sampler_penalises_what_it_sampled() -> None:
    """Greedy with a frequency penalty of 2 on [2, -1, 0.5, 3, -2, 0]: 3 (3.0); then 3 is
    1.0 so 0 (2.0); then 0 is 0.0 so 3 (1.0); then 3 is -1.0 and 0 is 0.0, so 2 (0.5)."""
    sampler = StepSampler(CPU, 0, 6)
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    sampler.track({5: SequenceSampling(p)}, [])
    tokens = [sampler.sample(torch.tensor([ROW]), [5]).tokens[5] for _ in range(4)]
    assert tokens == [3, 0, 3, 2]
    sampler.track({}, [5])
    assert sampler.adjuster.history.slots == {}


def test_min_p_keeps_tokens_within_the_ratio_of_the_best() -> None:
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    p = SamplingParams(temperature=1.0, min_p=0.5)  # keeps p >= 0.25: tokens 0 and 1
    gens = [torch.Generator().manual_seed(i) for i in range(400)]
    drawn = Sampler()(logits.expand(400, 4).contiguous(), [p] * 400, gens).token_ids
    assert set(drawn) == {0, 1}
    share = drawn.count(0) / 400
    assert 0.5 < share < 0.75  # 0.5 / 0.8 = 0.625 after renormalising


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("min_p", 1.5), ("logit_bias", {3: 101.0}), ("logit_bias", {-1: 1.0}),
])
def test_out_of_range_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SamplingParams(**{field: value})
