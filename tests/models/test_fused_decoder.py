"""The one-call C decoder forward against the modules: bit-identical hidden states and KV
writes for plain decode rows and a verify step's rows, across the Llama family's
variants (tied head, biases, GQA, a sliding window)."""

from __future__ import annotations

import pytest
import torch
from helpers.scheduled import Scheduled as _Seq

from meshserve.engine.worker.model_runner import ModelRunner
from meshserve.engine.worker.step_inputs import build_step_inputs
from meshserve.kernels import native_cpu
from meshserve.models.fused_decoder import FusedDecoder
from meshserve.models.loader import load_model

pytestmark = pytest.mark.skipif(native_cpu.library() is None, reason="needs the C kernels")

BLOCK = 4


def _runner(path, layout: str = "packed") -> ModelRunner:
    model = load_model(path, progress=False, cpu_weight_layout=layout)
    attn = model.attention_layers()[0]
    shape = (24, BLOCK, attn.num_kv_heads, attn.head_dim)
    cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.attention_layers()]
    return ModelRunner(model, cache, BLOCK, torch.device("cpu"))


def _prefill(runner: ModelRunner, gen: torch.Generator) -> list[_Seq]:
    """Three sequences of 5, 13 and 22 prompt tokens, run through the modules."""
    seqs = []
    for i, n in enumerate((5, 13, 22)):
        table = list(range(8 * i, 8 * i + 8))
        ids = torch.randint(0, 320, (n,), generator=gen).tolist()
        seqs.append(_Seq(i, ids, 0, table))
    runner.execute(seqs)
    return seqs


def _both(runner: ModelRunner, step: list[_Seq]) -> None:
    """The step through the modules and through the fused call, from the same cache."""
    fused = runner.fused
    assert fused is not None
    inputs = build_step_inputs(step, BLOCK, torch.device("cpu"))
    assert fused.applies(inputs.meta)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_cache]
    runner.fused = None
    plain = runner.forward(inputs)
    after = [(k.clone(), v.clone()) for k, v in runner.kv_cache]
    for (k, v), (k0, v0) in zip(runner.kv_cache, before):
        k.copy_(k0)
        v.copy_(v0)
    runner.fused = fused
    out = runner.forward(inputs)
    assert torch.equal(out, plain)
    for (k, v), (k1, v1) in zip(runner.kv_cache, after):
        assert torch.equal(k, k1) and torch.equal(v, v1)


@pytest.mark.parametrize("family,overrides", [
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"tie_word_embeddings": False, "num_key_value_heads": 1}),
    ("qwen2", {}),  # q, k and v biases
    ("mistral", {"sliding_window": 6}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
])
def test_fused_rows_match_the_modules(make_checkpoint, one_thread, family: str,
                                      overrides: dict) -> None:
    runner = _runner(make_checkpoint(family, seed=3, **overrides))
    gen = torch.Generator().manual_seed(0)
    seqs = _prefill(runner, gen)
    # Plain decodes: one row per sequence, each at its own length.
    for _ in range(3):
        step = [_Seq(s.seq_id, [int(torch.randint(0, 320, (1,), generator=gen))],
                     len(s.token_ids), s.block_table) for s in seqs]
        _both(runner, step)
        runner.execute(step)
        for s, d in zip(seqs, step):
            s.token_ids = s.token_ids + d.token_ids
    # A verify step: the second sequence's last token and three drafts (four rows, each up
    # to its own position), beside a plain decode of the others.
    ids = torch.randint(0, 320, (4,), generator=gen).tolist()
    step = [_Seq(0, ids[:1], len(seqs[0].token_ids), seqs[0].block_table),
            _Seq(1, ids, len(seqs[1].token_ids), seqs[1].block_table, num_drafts=3),
            _Seq(2, ids[1:2], len(seqs[2].token_ids), seqs[2].block_table)]
    _both(runner, step)


@pytest.mark.parametrize("threads", [2, 3])
def test_fused_rows_on_the_pool_match_the_modules_on_one_thread(make_checkpoint, one_thread,
                                                                 threads: int) -> None:
    """The fused call splits each linear's panels over the C pool's threads: the same bits
    as the modules on one thread."""
    runner = _runner(make_checkpoint("llama", seed=3, intermediate_size=1400))
    gen = torch.Generator().manual_seed(1)
    seqs = _prefill(runner, gen)
    step = [_Seq(s.seq_id, [int(torch.randint(0, 320, (1,), generator=gen))],
                 len(s.token_ids), s.block_table) for s in seqs]
    inputs = build_step_inputs(step, BLOCK, torch.device("cpu"))
    fused = runner.fused
    assert fused is not None
    before = [(k.clone(), v.clone()) for k, v in runner.kv_cache]
    runner.fused = None
    plain = runner.forward(inputs)
    for (k, v), (k0, v0) in zip(runner.kv_cache, before):
        k.copy_(k0)
        v.copy_(v0)
    runner.fused = fused
    torch.set_num_threads(threads)
    assert torch.equal(runner.forward(inputs), plain)


def test_where_the_fused_call_does_not_apply(make_checkpoint, one_thread) -> None:
    path = make_checkpoint("llama", seed=3)
    assert _runner(path, "row").fused is None  # weights not packed: the modules
    runner = _runner(path)
    assert runner.fused is not None
    prompt = build_step_inputs([_Seq(0, [1, 2, 3], 0, [0, 1])], BLOCK, torch.device("cpu"))
    assert not runner.fused.applies(prompt.meta)  # a prompt chunk: the modules
    decode = build_step_inputs([_Seq(0, [4], 3, [0, 1])], BLOCK, torch.device("cpu"))
    assert runner.fused.applies(decode.meta)
    torch.set_num_threads(2)  # the fused call splits its linears over the pool too
    wide = build_step_inputs([_Seq(i, [4], 3, [0, 1]) for i in range(300)], BLOCK,
                             torch.device("cpu"))
    assert runner.fused.applies(wide.meta)
    runner.fused.bf16_batches = True  # a bf16 model's batches take bf16 kernels: the modules
    assert not runner.fused.applies(wide.meta)
    assert FusedDecoder.build(load_model(path, progress=False, dtype=torch.float64)) is None
