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
