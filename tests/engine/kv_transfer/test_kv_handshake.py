"""The KV transfer handshake names every field the two sides disagree on."""

from __future__ import annotations

import dataclasses

import pytest

from meshserve.engine.kv_transfer.handshake import KVHandshakeError, KVSpec, check_handshake

SPEC = KVSpec(model="meshcoder", block_size=16, dtype="float32", num_layers=4,
              num_kv_heads=2, head_dim=32)


def test_tp_and_pp_may_differ() -> None:
    check_handshake(SPEC, dataclasses.replace(SPEC, tp=2, pp=2))


def test_every_mismatch_is_named_with_both_sides() -> None:
    other = dataclasses.replace(SPEC, block_size=32, dtype="bfloat16")
    with pytest.raises(KVHandshakeError) as e:
        check_handshake(SPEC, other)
    msg = str(e.value)
    assert "engine.block_size: prefill 16, decode 32" in msg
    assert "engine.kv_cache_dtype: prefill 'float32', decode 'bfloat16'" in msg
    assert "only tp and pp may differ" in msg
    with pytest.raises(KVHandshakeError, match="model: prefill 'meshcoder', decode 'x'"):
        check_handshake(SPEC, dataclasses.replace(SPEC, model="x"))
