"""The benchmark workloads (docs/benchmarks/README.md): seeded, shaped as specified, round-tripping through JSON files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshserve.bench import workloads as w

VOCAB = 32000


def test_longtail_matches_bench_md() -> None:
    reqs = w.longtail(VOCAB)
    assert len(reqs) == 64 and reqs == w.longtail(VOCAB) and reqs != w.longtail(VOCAB, seed=1)
    assert all(32 <= len(r.prompt_token_ids) <= 512 for r in reqs)
    assert all(8 <= r.max_new_tokens <= 64 or 128 <= r.max_new_tokens <= 256 for r in reqs)
    assert any(r.max_new_tokens >= 128 for r in reqs) and any(r.max_new_tokens <= 64 for r in reqs)
    assert all(r.arrival_s == 0.0 for r in reqs)


def test_shared_prefix_latency_and_short() -> None:
    sp = w.shared_prefix(VOCAB)
    assert len(sp) == 32 and all(r.max_new_tokens == 32 for r in sp)
    assert all(r.prompt_token_ids[:384] == sp[0].prompt_token_ids[:384] for r in sp)
    assert all(400 <= len(r.prompt_token_ids) <= 448 for r in sp)
    (lat,) = w.latency(VOCAB)
    assert len(lat.prompt_token_ids) == 256 and lat.max_new_tokens == 128
    short = w.short(VOCAB)
    assert len(short) == 16 and all(32 <= len(r.prompt_token_ids) <= 128 for r in short)
    assert all(16 <= r.max_new_tokens <= 64 for r in short)


def test_poisson_arrivals_increase_and_keep_the_requests() -> None:
    base = w.longtail(VOCAB)[:10]
    online = w.poisson(base, rate=4.0)
    times = [r.arrival_s for r in online]
    assert times == sorted(times) and times[0] > 0
    assert [r.prompt_token_ids for r in online] == [r.prompt_token_ids for r in base]


def test_resolve_caps_and_applies_a_rate() -> None:
    reqs = w.resolve("longtail", VOCAB, num_requests=5)
    assert reqs == w.longtail(VOCAB)[:5]
    online = w.resolve("online", VOCAB, num_requests=3, rate=2.0)
    assert len(online) == 3 and online[-1].arrival_s > 0


def test_resolve_draws_more_requests_than_a_workload_s_default() -> None:
    more = w.resolve("rag", VOCAB, num_requests=72)
    assert len(more) == 72 and more[:48] == w.rag(VOCAB)  # the first ones do not move
    assert len(w.resolve("online", VOCAB, num_requests=100, rate=1.0)) == 100


def test_resolve_refuses_more_requests_than_a_fixed_set_holds(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"bench.num_requests=2.*'latency' holds 1"):
        w.resolve("latency", VOCAB, num_requests=2)
    path = tmp_path / "wl.json"
    w.save(w.short(100)[:4], path)
    with pytest.raises(ValueError, match=r"bench.num_requests=5.*holds 4"):
        w.resolve(str(path), 100, num_requests=5)


def test_save_load_round_trip(tmp_path: Path) -> None:
    reqs = w.poisson(w.short(100)[:4], rate=1.0)
    path = tmp_path / "wl.json"
    w.save(reqs, path)
    assert w.load(path) == reqs
    assert w.resolve(str(path), 100) == reqs
    assert set(json.loads(path.read_text())["requests"][0]) == {
        "prompt_token_ids", "max_new_tokens", "arrival_s"}


@pytest.mark.parametrize(("spec", "content", "message"), [
    ("nope", None, r"bench\.workload='nope' is invalid: allowed is one of \['latency', "),
    ("missing.json", None, r"bench\.workload=.*missing\.json.*not a readable workload file"),
    ("bad.json", "{not json", r"not a readable workload file"),
    ("keys.json", '{"requests": [{"prompt": [1]}]}', r"not a readable workload file"),
    ("empty.json", '{"requests": []}', r"bench\.workload=.*: no requests"),
    ("vocab.json", '{"requests": [{"prompt_token_ids": [5, 100], "max_new_tokens": 2}]}',
     r"request 0: prompt_token_ids outside \[0, 100\)"),
    ("zero.json", '{"requests": [{"prompt_token_ids": [5], "max_new_tokens": 0}]}',
     r"request 0: max_new_tokens=0"),
    ("online", None, r"bench\.workload='online' needs bench\.rate"),
])
def test_bad_workloads_name_bench_workload(tmp_path: Path, spec: str, content: str | None,
                                           message: str) -> None:
    if content is not None:
        (tmp_path / spec).write_text(content)
    path = str(tmp_path / spec) if spec.endswith(".json") else spec
    with pytest.raises(ValueError, match=message):
        w.resolve(path, 100)
