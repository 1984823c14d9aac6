"""The data-parallel router: cache-aware (the replica whose earlier prompts match the
longest prefix, unless load is out of balance), least-loaded and round-robin."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.engine.replicas.router import BALANCE_ABS, PromptTree, Router


def tenant_prompts(seed: int = 0, tenants: int = 8, n: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.randint(300, 600))]
               for _ in range(tenants)]
    return [systems[rng.randrange(tenants)] + [rng.randrange(1000) for _ in range(32)]
            for _ in range(n)]


def test_a_tenant_sticks_to_the_replica_holding_its_system_prompt() -> None:
    r = Router("cache_aware", 2, 16, capacity_blocks=10_000)
    seen: dict[tuple[int, ...], set[int]] = {}
    for p in tenant_prompts():
        target = r.pick(p, len(p) + 16)
        seen.setdefault(tuple(p[:64]), set()).add(target)
        r.done(target, len(p) + 16)  # finished before the next arrives: load stays even
    assert all(len(s) == 1 for s in seen.values())  # each tenant on one replica
    assert {t for s in seen.values() for t in s} == {0, 1}  # and both replicas used
    assert r.num_cache_routed == 64 - len(seen)


def test_load_out_of_balance_goes_to_the_least_loaded_replica() -> None:
    r = Router("cache_aware", 2, 16, capacity_blocks=10_000)
    p = tenant_prompts(n=1)[0]
    first = r.pick(p, BALANCE_ABS + 1)  # outstanding: far past the threshold
    assert r.pick(p, 100) != first  # the same prefix, but its replica is swamped
    assert r.load[first] == BALANCE_ABS + 1 and r.load[1 - first] == 100


def test_least_loaded_and_round_robin() -> None:
    ll = Router("least_loaded", 3, 16, 100)
    assert [ll.pick([1] * 40, w) for w in (50, 10, 20, 5)] == [0, 1, 2, 1]
    rr = Router("round_robin", 3, 16, 100)
    assert [rr.pick([1] * 40, 1) for _ in range(5)] == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match=r"parallel.router='fastest': allowed is one of"):
        Router("fastest", 2, 16, 100)


def test_a_tree_forgets_leaves_first_past_capacity() -> None:
    """As a replica's cache does: the chain's last blocks go before its root, so what
    stays still matches from the start."""
    t = PromptTree(4, capacity=3)
    a, b = t.chain(list(range(12))), t.chain(list(range(100, 108)))
    assert len(a) == 3 and t.chain(list(range(13))) == a  # a part block is not hashed
    t.insert(a)
    assert t.match(a) == 3
    t.insert(b)  # a's last two blocks go; its first stays and still matches
    assert len(t) == 3 and t.match(b) == 2 and t.match(a) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12)), min_size=1, max_size=40),
       st.integers(1, 20))
def test_every_block_held_keeps_its_prefix_held(inserts: list[tuple[int, int]],
                                                capacity: int) -> None:
    """Leaves-first eviction never orphans a block: over any inserts of chains sharing
    prefixes (6 roots, tails of up to 12 blocks), each chain's held blocks are exactly
    the ones `match` reaches from its start."""
    t = PromptTree(2, capacity)
    chains = {(root, n): t.chain([root, root] + [root * 100 + i for i in range(2 * n)])
              for root in range(6) for n in range(13)}
    for key in inserts:
        t.insert(chains[key])
        assert len(t) <= capacity
        for chain in chains.values():
            held = sum(h in t._blocks for h in chain)
            assert t.match(chain) == held


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 3000), st.booleans()),
                max_size=60),
       st.sampled_from(["cache_aware", "least_loaded", "round_robin"]))
def test_load_is_what_was_picked_and_not_yet_done(ops: list[tuple[int, int, bool]],
                                                   policy: str) -> None:
    r = Router(policy, 3, 16, capacity_blocks=64)
    prompts = tenant_prompts(n=8)
    live: list[tuple[int, int]] = []
    for tenant, work, finish in ops:
        if finish and live:
            r.done(*live.pop(0))
        target = r.pick(prompts[tenant], work)
        assert 0 <= target < 3
        live.append((target, work))
        assert all(len(t) <= 64 for t in r.trees)
    for i in range(3):
        assert r.load[i] == sum(w for t, w in live if t == i)


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded", "round_robin"])
def test_a_dropped_replica_gets_nothing_more(policy: str) -> None:
    router = Router(policy, 3, block_size=4, capacity_blocks=64)
    prompt = list(range(40))
    first = router.pick(prompt, 10)
    router.drop(first)
    picks = {router.pick(prompt if i % 2 else list(range(100 + i, 140 + i)), 10)
             for i in range(12)}
    assert first not in picks and picks <= {0, 1, 2}
    for other in picks:
        router.drop(other)
    with pytest.raises(RuntimeError, match="no replica left"):
        router.pick(prompt, 10)
