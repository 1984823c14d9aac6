"""The handshake of a KV transfer: what the prefill and the decode side must agree on
before a block moves. TP and PP may differ (heads are resharded, layers gathered from each
stage); the model, block size, KV cache dtype and per-token KV layout must not."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KVSpec:
    """One side's KV layout as the other must see it."""

    model: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp: int = 1
    pp: int = 1


MUST_MATCH = ("model", "block_size", "dtype", "num_layers", "num_kv_heads", "head_dim")
"""What both sides must share; `tp` and `pp` may differ."""

_FIELD = {"model": "model", "block_size": "engine.block_size", "dtype": "engine.kv_cache_dtype",
          "num_layers": "num_hidden_layers", "num_kv_heads": "num_key_value_heads",
          "head_dim": "head_dim"}


class KVHandshakeError(ValueError):
    """The two sides of a KV transfer disagree on something that must match."""


def check_handshake(prefill: KVSpec, decode: KVSpec) -> None:
    """Raise KVHandshakeError naming every field that differs, with both sides' values."""
    assert {f.name for f in fields(KVSpec)} >= set(MUST_MATCH)
    bad = [f"{_FIELD[name]}: prefill {getattr(prefill, name)!r}, decode "
           f"{getattr(decode, name)!r}"
           for name in MUST_MATCH if getattr(prefill, name) != getattr(decode, name)]
    if bad:
        raise KVHandshakeError("KV transfer handshake failed, the prefill and decode sides "
                               "differ in " + "; ".join(bad) + ": allowed is the same value "
                               "on both sides (only tp and pp may differ)")
