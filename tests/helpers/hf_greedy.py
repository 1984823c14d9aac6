"""transformers' greedy continuation of each prompt with each token's log-probability: the
oracle of the tests that compare log-probabilities, not only tokens."""

from __future__ import annotations

import torch


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int = 12
              ) -> tuple[list[list[int]], list[list[float]]]:
    """`max_new_tokens` greedy tokens per prompt (EOS ignored) and their log-probabilities."""
    tokens, logprobs = [], []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        ids = out.sequences[0, len(p):].tolist()
        tokens.append(ids)
        logprobs.append([torch.log_softmax(step[0].float(), -1)[t].item()
                         for step, t in zip(out.logits, ids)])
    return tokens, logprobs


def assert_engine_matches(path: object, overrides: list[str], prompts: list[list[int]],
                          want: tuple[list[list[int]], list[list[float]]],
                          max_new_tokens: int = 12) -> None:
    """meshserve's greedy tokens of `prompts` under `overrides` are `want`'s (hf_greedy's),
    their log-probabilities within 1e-4."""
    from meshserve import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    llm = LLM(str(path), overrides=overrides, progress=False)
    try:
        outs = llm.generate(prompts, greedy)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == want[0]
    ours = torch.tensor([[lp for lp, _ in o.logprobs] for o in outs])
    assert (ours - torch.tensor(want[1])).abs().max() < 1e-4
