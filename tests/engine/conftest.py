"""Engine fixtures: a mixed-length batch of prompts and transformers' greedy output for it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Prompts crossing block edges (1..64 tokens) over the 320-token test vocabulary."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 320, (int(n),), generator=gen).tolist()
            for n in (1, 3, 8, 15, 16, 17, 31, 40, 57, 64)]


@pytest.fixture(scope="session")
def expected(make_checkpoint, hf_reference, prompts) -> list[list[int]]:
    """transformers' 12 greedy tokens for each prompt (EOS ignored)."""
    hf = hf_reference(make_checkpoint("llama"))
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out
