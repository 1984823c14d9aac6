"""Verifying drafted tokens against the target model, losslessly (Leviathan et al. 2023,
Chen et al. 2023), batched on the device.

A sequence with k drafts x_1..x_k has k + 1 target distributions p_0..p_k (after its
temperature, top-k and top-p): p_j is the target's next-token distribution after the j-th
draft. Draft x_j+1 is accepted iff u <= p_j(x) / q_j(x), q being the draft's distribution
(a point mass for n-gram drafts: accept with probability p_j(x)). At the first rejection
the token is drawn from max(0, p_j - q_j), normalised; if all k pass, a bonus token is drawn
from p_k. The emitted tokens then follow the target distribution exactly, whatever q is.
Greedy rows accept while the draft is the target's argmax and end with the argmax.

Each sequence draws its k + 1 uniforms from its own generator, so a seeded request's
output does not depend on what shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verified:
    """Per sequence: the tokens emitted (accepted drafts, then one more) and how many of
    its drafts were accepted."""

    tokens: list[list[int]]
    num_accepted: list[int]


def verify_greedy_lists(best: Sequence[Sequence[int]],
                        drafts: Sequence[Sequence[int]]) -> Verified:
    """Greedy rows only: accept while the draft is the target's argmax, then the argmax.
    best[b]: the target's argmax at each of row b's len(drafts[b]) + 1 positions."""
    tokens, accepted = [], []
    for row, d in zip(best, drafts):
        a = 0
        while a < len(d) and d[a] == row[a]:
            a += 1
        tokens.append(list(d[:a]) + [row[a]])
        accepted.append(a)
    return Verified(tokens, accepted)


def verify(target_probs: torch.Tensor, drafts: Sequence[Sequence[int]],
           draft_probs: torch.Tensor | None, greedy: Sequence[bool],
           generators: Sequence[torch.Generator | None],
           target_argmax: torch.Tensor | None = None) -> Verified:
    """target_probs [B, K + 1, V] (row b's first len(drafts[b]) + 1 positions are used);
    drafts: B lists of at most K tokens; draft_probs [B, K, V] or None (point masses);
    target_argmax [B, K + 1]: the greedy rows' choices (argmax of the unprocessed logits;
    computed from target_probs if None)."""
    b, kp1, vocab = target_probs.shape
    k = kp1 - 1
    dev = target_probs.device
    lens = torch.tensor([len(d) for d in drafts], device=dev)
    padded = torch.zeros(b, max(k, 1), dtype=torch.long)
    for i, d in enumerate(drafts):
        if d:
            padded[i, :len(d)] = torch.tensor(list(d))
    draft_t = padded.to(dev)[:, :k]
    if target_argmax is None:
        target_argmax = target_probs.argmax(dim=-1)
    u = torch.zeros(b, kp1, device=dev)
    for i, gen in enumerate(generators):
        if not greedy[i]:
            u[i].uniform_(generator=gen)
    positions = torch.arange(k, device=dev).unsqueeze(0)
    in_draft = positions < lens.unsqueeze(1)
    p_x = target_probs[:, :k].gather(-1, draft_t.unsqueeze(-1)).squeeze(-1)
    q_x = (draft_probs.gather(-1, draft_t.unsqueeze(-1)).squeeze(-1) if draft_probs is not None
           else torch.ones_like(p_x))
    is_greedy = torch.tensor(list(greedy), dtype=torch.bool, device=dev).unsqueeze(1)
    accept = torch.where(is_greedy, draft_t == target_argmax[:, :k], u[:, :k] * q_x <= p_x)
    accept &= in_draft
    # Accepted drafts: the run of acceptances from the start.
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(b, device=dev)
    p_last = target_probs[rows, num_accepted]  # [B, V]: where the extra token is drawn
    rejected = num_accepted < lens
    q_last = torch.zeros_like(p_last)  # the draft's distribution at the rejection
    if k:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is not None:
            q_last = draft_probs[rows, at]
        else:
            q_last[rows, draft_t[rows, at]] = 1.0
    residual = (p_last - q_last).clamp_(min=0.0)
    # Where a rejection happened, draw from the residual; else (all accepted) from p.
    dist = torch.where(rejected.unsqueeze(1), residual, p_last)
    mass = dist.sum(dim=1, keepdim=True)
    dist = torch.where(mass > 0, dist, p_last)  # p == q exactly: the residual is empty
    cdf = dist.cumsum(dim=1)
    pick = torch.searchsorted(cdf, (u[:, k:k + 1] * cdf[:, -1:]).contiguous(), right=True)
    extra = pick.squeeze(1).clamp_(max=vocab - 1)
    extra = torch.where(is_greedy.squeeze(1), target_argmax[rows, num_accepted], extra)
    acc, ext, dr = num_accepted.tolist(), extra.tolist(), draft_t.tolist()
    return Verified([dr[i][:acc[i]] + [ext[i]] for i in range(b)], acc)
