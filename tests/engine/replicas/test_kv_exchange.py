"""A prompt's KV prefilled by one engine and shipped into another: the receiver computes
only the last partial block, asks only for blocks it does not cache, and its greedy output
equals transformers' and the sender's; block counts come back to baseline on both."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.engine.core.sequence import Sequence
from meshserve.engine.kv_transfer.handshake import KVHandshakeError, check_handshake
from meshserve.engine.replicas.kv_exchange import export_prompt_kv, import_prompt_kv, kv_spec

ONE_RANK = ["parallel=single", "threads=1", "engine.block_size=8"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(make_checkpoint):
    path = str(make_checkpoint("llama"))
    prefill = LLM(path, overrides=ONE_RANK, progress=False)
    decode = LLM(path, overrides=ONE_RANK, progress=False)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_shipped_kv_decodes_like_a_local_prefill(pair, prompts, expected) -> None:
    prefill, decode = pair
    p, d = prefill.engine, decode.engine
    check_handshake(kv_spec(p), kv_spec(d))
    asked: list[int] = []
    for prompt, want in zip(prompts, expected, strict=True):
        first = prefill.generate([prompt], FIRST)
        assert first[0].token_ids == want[:1]  # the prefill replica's first token

        def fetch(first_block: int, prompt: list[int] = prompt) -> torch.Tensor:
            asked.append(first_block)
            packed = export_prompt_kv(p, prompt, first_block)
            assert packed is not None
            return packed

        held = import_prompt_kv(d, prompt, fetch)
        assert held == (len(prompt) - 1) // 8 * 8
        out = decode.generate([prompt], GREEDY)[0]
        assert out.token_ids == want, prompt
        assert out.metrics.num_cached_tokens == held  # only the partial block was computed here
    for e in (p, d):
        bm = e.scheduler.block_manager
        assert bm.num_used_blocks == 0
        bm.check_invariants()


def test_blocks_the_receiver_caches_are_not_asked_for(pair, prompts) -> None:
    prefill, decode = pair
    prompt = prompts[-1]  # 64 tokens: 7 full blocks before the last token
    decode.engine.reset_prefix_cache()
    decode.generate([prompt[:24] + [1] * 9], FIRST)  # caches 3 + 1 blocks
    prefill.generate([prompt], FIRST)
    asked: list[int] = []

    def fetch(first_block: int) -> torch.Tensor:
        asked.append(first_block)
        packed = export_prompt_kv(prefill.engine, prompt, first_block)
        assert packed is not None and packed.shape[2] == 7 - first_block
        return packed

    assert import_prompt_kv(decode.engine, prompt, fetch) == 56
    assert asked == [3]


def test_a_failed_fetch_caches_nothing_and_frees_its_blocks(pair, prompts) -> None:
    _, decode = pair
    d = decode.engine
    d.reset_prefix_cache()
    bm = d.scheduler.block_manager
    free = bm.num_free_blocks

    def broken(first_block: int) -> torch.Tensor:
        assert bm.num_used_blocks == 7  # pinned while the transfer runs
        raise ConnectionError("prefill replica went away")

    with pytest.raises(ConnectionError):
        import_prompt_kv(d, prompts[-1], broken)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == free
    assert import_prompt_kv(d, prompts[-1], lambda first: None) == 0  # evicted at the sender
    assert bm.find_cached_prefix(Sequence(-1, list(prompts[-1]), max_tokens=1)) == []
    bm.check_invariants()


def test_the_handshake_refuses_another_block_size(pair) -> None:
    prefill, _ = pair
    spec = kv_spec(prefill.engine)
    with pytest.raises(KVHandshakeError, match="engine.block_size: prefill 8, decode 16"):
        check_handshake(spec, dataclasses.replace(spec, block_size=16))

