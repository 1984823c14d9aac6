"""CPU weight layouts: linear weights packed in panels for the C kernel, or wide ones
stored column-major for MKL; the same logits either way."""

from __future__ import annotations

import pytest
import torch

from meshserve.engine.worker.model_runner import ModelRunner
from meshserve.kernels import dispatch, native_cpu
from meshserve.kernels.dispatch import out_features, packed_columns
from meshserve.kernels.host_memory import HUGE_PAGE_BYTES
from meshserve.models.loader import column_major_wide_weights, load_model

native = pytest.mark.skipif(native_cpu.library() is None, reason="needs the C kernels")


class _Seq:
    def __init__(self, token_ids: list[int]) -> None:
        self.seq_id, self.token_ids, self.start_pos = 0, token_ids, 0
        self.block_table, self.sample, self.num_drafts = [0, 1], True, 0
        self.prompt_targets: list[int] | None = None


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    attn = model.attention_layers()[0]
    shape = (2, 16, attn.num_kv_heads, attn.head_dim)
    cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.attention_layers()]
    return ModelRunner(model, cache, 16, torch.device("cpu")).execute([_Seq(ids)])[0]


def test_wide_weights_go_column_major_and_logits_stay(make_checkpoint) -> None:
    path = make_checkpoint("llama", seed=7, tie_word_embeddings=False)
    model = load_model(path, progress=False, cpu_weight_layout="column")  # converted on load
    layer = model.model.layers["0"]
    gate_up = layer.mlp.gate_up_proj.weight
    assert gate_up.stride() == (1, gate_up.shape[0])
    assert model.lm_head.weight.stride()[0] == 1  # untied LM head: wide, converted
    assert layer.self_attn.o_proj.weight.is_contiguous()  # square: kept
    assert layer.mlp.down_proj.weight.is_contiguous()  # narrow: kept
    assert model.model.embed_tokens.weight.is_contiguous()  # the embedding gathers rows
    row_major = load_model(path, progress=False, cpu_weight_layout="row")
    assert row_major.model.layers["0"].mlp.gate_up_proj.weight.is_contiguous()
    ids = [3, 14, 15, 92, 65]
    torch.testing.assert_close(_logits(model, ids), _logits(row_major, ids), atol=1e-5,
                               rtol=1e-5)
    # qkv and gate_up of every layer, and the LM head
    assert column_major_wide_weights(row_major) == 2 * len(row_major.model.layers) + 1


def test_a_tied_lm_head_stays_row_major_for_mkl(make_checkpoint, one_thread) -> None:
    model = load_model(make_checkpoint("llama", seed=7, tie_word_embeddings=True),
                       progress=False, cpu_weight_layout="column")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.is_contiguous()  # the embedding gathers its rows
    assert packed_columns(model.lm_head.weight) is None


@native
@pytest.mark.parametrize("layout", ["auto", "packed"])
def test_a_tied_lm_head_is_packed_once(make_checkpoint, one_thread, layout: str) -> None:
    """Packed, the tied head's panels are the embedding's table too: stored once, the
    embedding gathering its rows from them; the same embeddings and logits as row-major."""
    path = make_checkpoint("llama", seed=7, tie_word_embeddings=True)
    model = load_model(path, progress=False, cpu_weight_layout=layout)
    row = load_model(path, progress=False, cpu_weight_layout="row")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert packed_columns(model.lm_head.weight) == 320
    ids = torch.tensor([[0, 23, 24, 319], [5, 5, 47, 48]])
    emb = model.model.embed_tokens(ids)
    assert torch.equal(emb, row.model.embed_tokens(ids))
    panel = model.lm_head.weight.shape[2]
    assert torch.equal(model.lm_head.weight[ids // panel, :, ids % panel], emb)  # torch's way
    toks = [3, 14, 15, 92, 65]
    torch.testing.assert_close(_logits(model, toks), _logits(row, toks), atol=1e-5, rtol=1e-5)


@native
def test_auto_packs_every_linear_weight_with_one_thread(make_checkpoint, one_thread) -> None:
    path = make_checkpoint("llama", seed=7, tie_word_embeddings=False)
    packed = load_model(path, progress=False)  # auto, one thread: packed
    layer = packed.model.layers["0"]
    weights = [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
               layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight,
               packed.lm_head.weight]
    assert all(packed_columns(w) is not None for w in weights)
    assert packed.model.embed_tokens.weight.dim() == 2  # the embedding is not a linear
    row = load_model(path, progress=False, cpu_weight_layout="row")
    assert [out_features(w) for w in weights] == [
        w.shape[0] for w in (row.model.layers["0"].self_attn.qkv_proj.weight,
                             row.model.layers["0"].self_attn.o_proj.weight,
                             row.model.layers["0"].mlp.gate_up_proj.weight,
                             row.model.layers["0"].mlp.down_proj.weight, row.lm_head.weight)]
    ids = [3, 14, 15, 92, 65, 35, 89]
    torch.testing.assert_close(_logits(packed, ids), _logits(row, ids), atol=1e-5, rtol=1e-5)


@native
def test_several_threads_take_the_same_packed_weights(
        make_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed kernel splits its panels over torch's threads: the logits stay the same
    bits as on one thread."""
    monkeypatch.setattr(native_cpu, "THREAD_MIN_FLOPS", 1)  # split even these small ones
    path = make_checkpoint("llama", seed=7, tie_word_embeddings=False, vocab_size=4096)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        model = load_model(path, progress=False)
        assert packed_columns(model.lm_head.weight) == 4096
        ids = list(range(1, 30))
        two = _logits(model, ids)
        torch.set_num_threads(1)
        assert torch.equal(_logits(model, ids), two)
    finally:
        torch.set_num_threads(before)


def test_packed_is_refused_where_the_c_kernels_do_not_run(
        make_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_checkpoint("llama", seed=7, tie_word_embeddings=False)
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    dispatch.kernel_mode.cache_clear()
    try:
        model = load_model(path, progress=False)  # auto: column-major, as before packing
        assert packed_columns(model.lm_head.weight) is None
        assert model.lm_head.weight.stride()[0] == 1
        with pytest.raises(ValueError, match=r"model.cpu_weight_layout='packed' .*need fp32"):
            load_model(path, progress=False, cpu_weight_layout="packed")
        with pytest.raises(ValueError, match=r"model.cpu_weight_dtype=bfloat16\) need fp32"):
            load_model(path, progress=False, cpu_weight_dtype="bfloat16")
    finally:
        monkeypatch.delenv(dispatch.ENV_VAR)
        dispatch.kernel_mode.cache_clear()


@pytest.mark.parametrize("tied", [True, False])
def test_huge_page_weights_give_the_same_logits(make_checkpoint, tied: bool) -> None:
    # 8448 x 64 fp32 = 2.1 MB: the embedding (and an untied, column-major head) move.
    path = make_checkpoint("llama", seed=7, tie_word_embeddings=tied, vocab_size=8448)
    moved = load_model(path, progress=False)
    plain = load_model(path, progress=False, huge_pages=False)
    embed, head = moved.model.embed_tokens.weight, moved.lm_head.weight
    assert embed.data_ptr() % HUGE_PAGE_BYTES == 0 and head.data_ptr() % HUGE_PAGE_BYTES == 0
    assert (head is embed) == tied
    assert head.stride() == plain.lm_head.weight.stride()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(_logits(moved, ids), _logits(plain, ids))
