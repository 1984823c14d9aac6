"""The rejection sampler: greedy drafts accepted while they are the argmax; sampled drafts
leave the emitted tokens distributed as the target, whatever the draft distribution."""

from __future__ import annotations

import pytest
import torch

from meshserve.engine.worker.sampling.rejection_sampler import verify


def gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def one_hot_rows(tokens: list[int], vocab: int = 6) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def test_greedy_accepts_the_argmax_run_then_the_target_token() -> None:
    # Target argmax per position: 3, 1, 4, 2. Drafts [3, 1, 0]: two accepted, then 4.
    probs = one_hot_rows([3, 1, 4, 2]).unsqueeze(0) * 0.7 + 0.05
    out = verify(probs, [[3, 1, 0]], None, [True], [None])
    assert out.tokens == [[3, 1, 4]] and out.num_accepted == [2]
    every = verify(probs, [[3, 1, 4]], None, [True], [None])
    assert every.tokens == [[3, 1, 4, 2]] and every.num_accepted == [3]  # and the bonus
    none = verify(probs, [[5, 1, 4]], None, [True], [None])
    assert none.tokens == [[3]] and none.num_accepted == [0]


def test_rows_with_fewer_drafts_and_none() -> None:
    probs = torch.stack([one_hot_rows([3, 1, 4, 2]), one_hot_rows([2, 2, 2, 2]),
                         one_hot_rows([0, 5, 5, 5])]) * 0.7 + 0.05
    out = verify(probs, [[3, 1, 4], [2], []], None, [True] * 3, [None] * 3)
    assert out.tokens == [[3, 1, 4, 2], [2, 2], [0]]
    assert out.num_accepted == [3, 1, 0]


def target_and_draft(vocab: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, vocab, generator=g) ** 3
    p[:, 0] = 0.0  # a token the target never takes (top-k / top-p cut it)
    q = torch.rand(k, vocab, generator=g) ** 3
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-model", "ngram"])
def test_emitted_tokens_follow_the_target_distribution(point_mass: bool) -> None:
    """Target rows that do not depend on the prefix: the first two emitted tokens are
    then independent draws from p_0 and p_1, however the drafts were chosen."""
    vocab, k, n = 5, 2, 40000
    p, q = target_and_draft(vocab, k, seed=1)
    g = torch.Generator().manual_seed(99)
    if point_mass:  # a fixed guess, as prompt lookup makes
        drafts = [[1, 2]] * n
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g)
                              for j in range(k)], dim=1).tolist()
        draft_probs = q.expand(n, k, vocab)
    out = verify(p.expand(n, k + 1, vocab), drafts, draft_probs, [False] * n, gens(n))
    first = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=vocab) / n
    assert torch.allclose(first, p[0], atol=0.01), (first, p[0])
    pairs = [t[:2] for t in out.tokens if len(t) >= 2]
    second = torch.bincount(torch.tensor([t[1] for t in pairs]), minlength=vocab) / len(pairs)
    assert torch.allclose(second, p[1], atol=0.015), (second, p[1])
    assert all(t[0] != 0 for t in out.tokens)  # never a token of zero target mass
    accepted = sum(out.num_accepted) / n
    assert 0 < accepted < k


def test_a_draft_equal_to_the_target_is_always_accepted() -> None:
    vocab, k, n = 7, 3, 500
    p, _ = target_and_draft(vocab, k, seed=2)
    drafts = torch.stack([torch.multinomial(p[j], n, replacement=True,
                                            generator=torch.Generator().manual_seed(j))
                          for j in range(k)], dim=1).tolist()
    out = verify(p.expand(n, k + 1, vocab), drafts, p[:k].expand(n, k, vocab),
                 [False] * n, gens(n))
    assert out.num_accepted == [k] * n


def test_a_seeded_row_does_not_depend_on_its_neighbours() -> None:
    vocab, k = 6, 3
    p, q = target_and_draft(vocab, k, seed=3)
    drafts = [[1, 2, 3], [4, 4, 4], [2, 5, 1]]
    alone = verify(p.expand(1, k + 1, vocab), drafts[1:2], q.expand(1, k, vocab), [False],
                   [torch.Generator().manual_seed(7)])
    batch = verify(p.expand(3, k + 1, vocab), drafts, q.expand(3, k, vocab), [False] * 3,
                   [torch.Generator().manual_seed(s) for s in (5, 7, 9)])
    assert batch.tokens[1] == alone.tokens[0]


def test_the_greedy_shortcut_agrees_with_the_full_verification() -> None:
    from meshserve.engine.worker.sampling.rejection_sampler import verify_greedy_lists

    g = torch.Generator().manual_seed(4)
    probs = torch.rand(6, 4, 9, generator=g).softmax(-1)
    best = probs.argmax(-1)
    drafts = [best[i, :3].tolist() if i % 2 else [int(best[i, 0]), 8, 8] for i in range(6)]
    drafts[4] = []
    full = verify(probs, drafts, None, [True] * 6, [None] * 6)
    short = verify_greedy_lists([best[i, :len(d) + 1].tolist() for i, d in enumerate(drafts)],
                                drafts)
    assert short == full
