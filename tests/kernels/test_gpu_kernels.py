"""The Triton kernels compiled for a GPU, at serving shapes, and decode under CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import paged_attention as ref
from meshserve.kernels import triton_paged_decode as tpd
from meshserve.kernels import triton_paged_prefill as tpp
from meshserve.kernels import triton_rmsnorm as trn
from meshserve.kernels import triton_rotary as trot
from meshserve.kernels import triton_silu_mul as tsm
from meshserve.kernels import triton_write_kv as twk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")
BF16 = torch.bfloat16


def _cache(paged_cache, lens, hkv, d, bs, dtype):
    c = paged_cache(lens, hkv, d, bs, dtype)
    return c.k_cache.to(CUDA), c.v_cache.to(CUDA), c.block_tables.to(CUDA)


@pytest.mark.parametrize("per_iter", [0, 128])  # one block per loop step; the default gather
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("hkv,bs", [(8, 16), (1, 32)])
def test_decode(paged_cache, close, dtype, hkv, bs, per_iter) -> None:
    lens = [1, 17, 513, 3000, 4097]  # split-K; a small grid shrinks the splits
    k, v, tables = _cache(paged_cache, lens, hkv, 128, bs, dtype)
    q = torch.randn(len(lens), 32, 128, device=CUDA).to(dtype)
    ctx = torch.tensor(lens, device=CUDA)
    out = tpd.paged_decode(q, k, v, tables, ctx, 128 ** -0.5,
                           config=tpd.DecodeConfig(tokens_per_iter=per_iter))
    close(out, ref.paged_decode(q.float(), k.float(), v.float(), tables, ctx, 128 ** -0.5),
          dtype)


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
def test_prefill(paged_cache, close, dtype) -> None:
    chunks = [(0, 300), (256, 77), (1000, 129)]
    k, v, tables = _cache(paged_cache, [s + n for s, n in chunks], 8, 128, 16, dtype)
    lens = [n for _, n in chunks]
    starts = [sum(lens[:i]) for i in range(len(chunks))]
    q = torch.randn(sum(lens), 32, 128, device=CUDA).to(dtype)
    out = tpp.paged_prefill(q, k, v, tables, torch.tensor(starts, device=CUDA),
                            torch.tensor(lens, device=CUDA),
                            torch.tensor([s for s, _ in chunks], device=CUDA), max(lens),
                            128 ** -0.5)
    for i, (s, n) in enumerate(chunks):
        rows = slice(starts[i], starts[i] + n)
        close(out[rows], ref.paged_prefill(q[rows].float(), k.float(), v.float(), tables[i], s,
                                           128 ** -0.5), dtype)


def test_write_norm_rotary(close) -> None:
    k_cache = torch.zeros(64, 16, 8, 128, device=CUDA, dtype=BF16)
    v_cache, k_ref, v_ref = (torch.zeros_like(k_cache) for _ in range(3))
    qkv = torch.randn(100, 48, 128, device=CUDA, dtype=BF16)
    slots = torch.randperm(64 * 16, device=CUDA)[:100]
    twk.write_kv(qkv[:, 32:40], qkv[:, 40:], k_cache, v_cache, slots)
    ref.write_kv(qkv[:, 32:40], qkv[:, 40:], k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    x, res = torch.randn(2, 100, 4096, device=CUDA, dtype=BF16)
    w = torch.randn(4096, device=CUDA, dtype=BF16)
    out, new_res = trn.add_rms_norm(x, res, w, 1e-5)
    out_ref, res_ref = trn.add_rms_norm_reference(x, res, w, 1e-5)
    assert torch.equal(new_res, res_ref)
    close(out, out_ref, BF16)
    cos, sin = torch.randn(2, 100, 64, device=CUDA)
    close(trot.apply_rotary(qkv[:, :40], cos, sin),
          trot.apply_rotary_reference(qkv[:, :40], cos, sin), BF16)
    gate_up = torch.randn(100, 2 * 14336, device=CUDA, dtype=BF16)
    close(tsm.silu_and_mul(gate_up), tsm.silu_and_mul_reference(gate_up), BF16)


def test_decode_graphs_match_eager(make_checkpoint) -> None:
    """The same decode steps through captured graphs (padded buckets) and eagerly."""
    from meshserve.engine.worker.model_runner import ModelRunner
    from meshserve.models.loader import load_model

    path = make_checkpoint("llama", seed=4)

    def runner() -> ModelRunner:  # its own model: a runner binds the layers to its cache
        model = load_model(path, dtype=BF16, device=CUDA, progress=False)
        attn = model.attention_layers()[0]
        shape = (32, 16, attn.num_kv_heads, attn.head_dim)
        cache = [(torch.zeros(shape, dtype=BF16, device=CUDA),
                  torch.zeros(shape, dtype=BF16, device=CUDA))
                 for _ in model.attention_layers()]
        return ModelRunner(model, cache, 16, CUDA)

    class Seq:
        def __init__(self, i: int, ids: list[int], start: int) -> None:
            self.seq_id, self.token_ids, self.start_pos = i, ids, start
            self.block_table, self.sample = [3 * i, 3 * i + 1, 3 * i + 2], True
            self.num_drafts = 0

    steps = [[Seq(i, list(range(5 + i, 25 + 2 * i)), 0) for i in range(3)]]
    steps += [[Seq(i, [7 + t], 20 + i + t) for i in range(3)] for t in range(4)]
    last = [Seq(i, [9], 24 + i) for i in range(2)]
    last[1].sample = False  # a row that does not sample: gathered out after the graph
    steps.append(last)
    eager, graphed = runner(), runner()
    graphed.enable_cuda_graphs(max_num_seqs=8, max_model_len=48)
    for step in steps:
        (a, a_ids), (b, b_ids) = eager.execute(step), graphed.execute(step)
        assert a_ids == b_ids
        torch.testing.assert_close(b.float(), a.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("m", [1, 8, 16])
def test_gemv_at_llama_shapes(close, m: int) -> None:
    from meshserve.kernels import triton_gemv as tg

    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):
        x = torch.randn(m, k, device=CUDA, dtype=BF16)
        w = torch.randn(n, k, device=CUDA, dtype=BF16) / k ** 0.5
        for cfg in (tg.GemvConfig(), tg.GemvConfig(block_n=64, block_k=256, num_warps=8)):
            close(tg.gemv(x, w, None, cfg), tg.gemv_reference(x.float(), w.float()), BF16)
