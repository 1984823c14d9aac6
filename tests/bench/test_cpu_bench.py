"""The CPU benchmarks' arithmetic: the peer table's ratios, the bytes a decode step reads,
and the C read loop reading every byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshserve.bench.cpu_peers import Figures, table
from meshserve.bench.decode_bandwidth import step_bytes
from meshserve.kernels import native_cpu


def test_the_table_puts_ours_over_the_peers_for_rates_and_theirs_over_ours_for_times() -> None:
    ours = Figures([600.0, 500.0, 700.0], [8000.0] * 3, [0.05, 0.04, 0.06], [0.006] * 3,
                   [[1, 2], [3]])
    peer = Figures([500.0] * 3, [4000.0] * 3, [0.02] * 3, [0.012] * 3, [[1, 2], [4]])
    assert ours.summary() == {"longtail tok/s": 600.0, "prompt tok/s": 8000.0,
                              "TTFT(256) ms": 40.0, "batch-1 ms/tok": 6.0}
    text = table({1: {"meshserve": ours, "vllm": peer}}, "vllm")
    assert "| 1 | longtail tok/s | 600.0 | 500.0 | x1.20 |" in text
    assert "| 1 | TTFT(256) ms | 40.0 | 20.0 | x0.50 |" in text  # theirs / ours
    assert "| 1 | batch-1 ms/tok | 6.0 | 12.0 | x2.00 |" in text
    assert "| 1 | longtail outputs identical | 1 of 2 | | |" in text


def test_a_peer_without_batching_is_compared_on_latency_alone() -> None:
    ours = Figures([600.0], [8000.0], [0.05], [0.006], [[1]], [[5, 6]])
    peer = Figures([], [], [0.04], [0.007], [], [[5, 6]])  # llama.cpp: one at a time
    assert peer.summary() == {"TTFT(256) ms": 40.0, "batch-1 ms/tok": 7.0}
    text = table({2: {"meshserve": ours, "llamacpp": peer}}, "llamacpp")
    assert "longtail tok/s" not in text and "| 2 | batch-1 ms/tok | 6.0 | 7.0 | x1.17 |" in text
    assert "| 2 | latency outputs identical | 1 of 1 | | |" in text
    assert "tokens alike before the first difference | 2 of 2 |" in text


def test_a_decode_step_reads_every_linear_weight_and_the_head(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, '
        '"vocab_size": 10, "num_attention_heads": 2, "num_key_value_heads": 1}')
    weights, kv = step_bytes(tmp_path, 2)
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 2 * 8 * 16 + 16 * 8
    assert weights == (2 * per_layer + 10 * 8) * 2
    assert kv == 2 * 2 * 4 * 256 * 2


@pytest.mark.skipif(native_cpu.library() is None, reason="no C compiler")
def test_the_read_loop_reads_every_word() -> None:
    words = torch.randint(-2**62, 2**62, (4096 + 8,), dtype=torch.int64)
    start = (-words.data_ptr() % 64) // 8
    buf = words[start:start + 4096]
    assert native_cpu.read_bytes(buf) == int(np.bitwise_xor.reduce(buf.numpy())) % 2**64
