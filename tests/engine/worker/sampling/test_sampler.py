"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.worker.sampling.sampler import Sampler


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 2, [None, None])
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


def test_top_k_one_is_greedy_even_at_high_temperature() -> None:
    logits = torch.randn(4, 50, generator=gen(0))
    params = [SamplingParams(temperature=5.0, top_k=1)] * 4
    out = Sampler()(logits, params, [gen(i) for i in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(3, 100, generator=gen(1))
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [Sampler()(logits[1:2], [p], [gen(7)]).token_ids[0] for _ in range(3)]
    batched = Sampler()(logits, [SamplingParams(temperature=0.0), p,
                                 SamplingParams(temperature=0.8)],
                        [None, gen(7), gen(99)]).token_ids[1]
    assert alone == [batched] * 3


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.clamp_min(1e-12).log().expand(4000, 4)
    out = Sampler()(logits, [SamplingParams(temperature=1.0)] * 4000, [gen(0)] + [None] * 0
                    + [gen(i) for i in range(1, 4000)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 4000
    assert counts[3] == 0
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)


def test_top_p_keeps_the_nucleus_only() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(500, 4)
    params = [SamplingParams(temperature=1.0, top_p=0.7)] * 500
    out = Sampler()(logits, params, [gen(i) for i in range(500)])
    assert set(out.token_ids) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7


def test_top_k_keeps_k_tokens() -> None:
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6]).expand(500, 5)
    params = [SamplingParams(temperature=1.0, top_k=2)] * 500
    out = Sampler()(logits, params, [gen(i) for i in range(500)])
    assert set(out.token_ids) == {0, 1}


def test_logprobs_of_sampled_and_top_tokens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0.0, logprobs=2)], [None])
    lp = logits.log_softmax(-1)[0]
    sampled, top = out.logprobs[0]
    assert sampled == pytest.approx(lp[0].item())
    assert [t for t, _ in top] == [0, 1]
    assert [v for _, v in top] == pytest.approx(lp[:2].tolist())


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"),
    ({"logprobs": 50}, "logprobs"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"temperature": float("nan")}, "temperature"),
])
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**kwargs)
