"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.worker.step_inputs import to_device
from meshserve.kernels import dispatch


@dataclass
class SampleResult:
    """Sampled tokens, and logprobs for the rows that asked for them."""

    token_ids: list[int]
    """One token per row."""
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]
    """Per row: (sampled token's logprob, top-n (token, logprob)), or None if not asked."""


class Sampler:
    """Samples one token per row of logits, each row under its own parameters.

    Random rows draw from their own torch.Generator (seeded per request), so a seeded
    request gives the same tokens whatever else is in the batch.
    """

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> SampleResult:
        """logits [N, V] -> N tokens."""
        logits = logits.float()
        token_list = self.sample_tokens(logits, params, generators).tolist()
        return SampleResult(token_list, self.logprobs(logits, params, token_list))

    def sample_tokens(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                      generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """logits [N, V] -> N tokens [N] (long) on the logits' device, without waiting for
        the device: the host learns them only when it reads the tensor."""
        greedy = [p.greedy for p in params]
        if all(greedy):
            return dispatch.argmax_rows(logits)
        return self._sample(logits.float(), params, generators, greedy)

    def _sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None], greedy: list[bool]) -> torch.Tensor:
        return self.draw(_processed(logits, params).softmax(dim=-1), logits, greedy,
                         generators)

    @staticmethod
    def draw(probs: torch.Tensor, logits: torch.Tensor, greedy: Sequence[bool],
             generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """One token per row of `probs` [N, V] (unnormalised is fine), from each row's own
        generator; greedy rows take the argmax of `logits`."""
        dev = logits.device
        # Inverse CDF: one uniform draw per row from the row's own generator (an exponential
        # race over the vocabulary drew one per token: 4 ms more per 4 rows of 32k here).
        u = torch.zeros(len(greedy), 1, device=dev)
        for i, gen in enumerate(generators):
            if not greedy[i]:
                u[i].uniform_(generator=gen)
        cdf = probs.cumsum(dim=-1)
        # The first token whose cumulative mass exceeds u (never a token of zero mass).
        sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        sampled = sampled.clamp_(max=logits.shape[-1] - 1)
        if not any(greedy):
            return sampled
        is_greedy = to_device(list(greedy), dev, torch.bool)
        return torch.where(is_greedy, dispatch.argmax_rows(logits), sampled)

    def probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """logits [N, V] -> each row's sampling distribution (after its temperature, min-p,
        top-k and top-p); greedy rows as at temperature 1 (their callers take the argmax)."""
        return _processed(logits, params).softmax(dim=-1).nan_to_num_(0.0)

    @staticmethod
    def logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                  tokens: list[int]) -> list[tuple[float, list[tuple[int, float]]] | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(params)
        if not rows:
            return out
        lp = logits[rows].log_softmax(dim=-1)
        for j, i in enumerate(rows):
            n = params[i].logprobs or 0
            top_v, top_i = lp[j].topk(n) if n else (lp[j][:0], lp[j][:0].long())
            out[i] = (float(lp[j, tokens[i]]), list(zip(top_i.tolist(), top_v.tolist())))
        return out


def _processed(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row scaled by its temperature (1 for a greedy row) and masked by its min-p,
    top-k and top-p: the logits a row samples from."""
    temp = to_device([1.0 if p.greedy else p.temperature for p in params], logits.device,
                     torch.float32).unsqueeze(1)
    scaled = _min_p(logits / temp, [p.min_p for p in params])
    return _top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params])


def _min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens whose probability is below min_p times the row's largest."""
    if not any(min_p):
        return logits
    # p(t) < m * p_max  <=>  l(t) < l_max + log(m): no softmax needed.
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(
        to_device(min_p, logits.device, torch.float32)).unsqueeze(1)
    return logits.masked_fill(logits < floor, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus."""
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    k = to_device([vocab if k == -1 else min(k, vocab) for k in top_k], logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = ranks >= k.unsqueeze(1)
    p = to_device(top_p, logits.device, torch.float32).unsqueeze(1)
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token).
    remove |= (probs.cumsum(dim=-1) - probs) >= p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)

