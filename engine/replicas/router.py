"""Which data-parallel replica a request goes to (parallel.router).

- `cache_aware` (the default; after SGLang's cache-aware router): the router keeps, per
  replica, an approximate tree of the prompts it sent there: the chained hashes of their
  full blocks of `block_size` tokens (a path from the root of a token trie, one node per
  block), bounded to about what the replica's KV cache holds, least recently used first
  out. A request goes to the replica whose tree matches the longest prefix of its prompt,
  when that is at least CACHE_THRESHOLD of the prompt; else to the least-loaded replica
  (of equals, the one whose tree holds least: the most room for a new prefix).
  Either way, when the load is out of balance (the busiest replica has more than
  BALANCE_ABS tokens of work and BALANCE_REL times the idlest's) the least-loaded
  replica takes it.
- `least_loaded`: the replica with the least work outstanding (prompt tokens plus tokens
  still allowed).
- `round_robin`: each replica in turn.

The tree is the router's guess, not the replicas' caches: a replica may have evicted a
block the tree still holds, or hold one computed for a request routed elsewhere (the
replicas' own prefix caches stay exact).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence

from meshserve.parallel.parallel_config import ROUTERS

CACHE_THRESHOLD = 0.5
"""The share of a prompt a replica's tree must match for the request to follow it there."""
BALANCE_ABS = 4096
BALANCE_REL = 1.5
"""Load out of balance: the busiest replica's outstanding tokens exceed BALANCE_ABS and
BALANCE_REL times the idlest's."""


def prompt_chain(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of `token_ids` (the router's own hash, not
    the replicas' block hashes): computed once per request, read by every tree."""
    out, h = [], 0
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[i:i + block_size])))
        out.append(h)
    return out


class PromptTree:
    """One replica's approximate prefix tree: chained block hashes, least recently used
    first out past `capacity` blocks."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size, self.capacity = block_size, capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def chain(self, token_ids: Sequence[int]) -> list[int]:
        """The chained hashes of the full blocks of `token_ids`."""
        return prompt_chain(token_ids, self.block_size)

    def match(self, chain: Sequence[int]) -> int:
        """Blocks of `chain` held, from its start."""
        n = 0
        for h in chain:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, chain: Sequence[int]) -> None:
        """Hold `chain` (its blocks now the most recently used), evicting past capacity.

        Leaves go first, as in the replicas' own caches: a chain is touched from its last
        block to its root, so a block is always more recent than every block after it
        on any chain held, and the least recent block is a leaf. Every block held keeps
        its whole prefix held: nothing unreachable by `match` stays."""
        blocks = self._blocks
        for h in reversed(chain):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


class Router:
    """Picks a replica per request; told when a request's work is done."""

    def __init__(self, policy: str, num_replicas: int, block_size: int,
                 capacity_blocks: int) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"parallel.router={policy!r}: allowed is one of {ROUTERS}")
        self.policy, self.num_replicas = policy, num_replicas
        self.load = [0] * num_replicas
        """Outstanding work per replica: prompt tokens plus tokens still allowed."""
        self.trees = [PromptTree(block_size, capacity_blocks) for _ in range(num_replicas)]
        self._turn = itertools.cycle(range(num_replicas))
        self.live = list(range(num_replicas))
        """The replicas requests may go to (a lost one is dropped)."""
        self.num_cache_routed = 0
        """Requests sent to a replica for the prefix its tree matched."""
        self.num_picks = 0
        self.pick_s = 0.0
        """Requests routed, and the seconds spent choosing (hashing included)."""

    def drop(self, replica: int) -> None:
        """Send nothing more to `replica` (its ranks are gone) and forget its tree."""
        if replica in self.live:
            self.live.remove(replica)
        self.trees[replica] = PromptTree(self.trees[replica].block_size, 0)

    def pick(self, token_ids: Sequence[int], work: int, chain: list[int] | None = None) -> int:
        """The replica for a request of `token_ids` with `work` tokens of work; counts the
        work as outstanding there (see `done`). `chain`: the prompt's `prompt_chain`,
        where the caller has it already."""
        t0 = time.perf_counter()
        target = self._choose(token_ids, chain)
        self.load[target] += work
        self.num_picks += 1
        self.pick_s += time.perf_counter() - t0
        return target

    def chain(self, token_ids: Sequence[int]) -> list[int] | None:
        """The prompt's `prompt_chain` where this policy reads it (cache_aware), else None."""
        if self.policy != "cache_aware":
            return None
        return prompt_chain(token_ids, self.trees[0].block_size)

    def done(self, replica: int, work: int) -> None:
        """A request's `work` on `replica` is over (finished or aborted)."""
        self.load[replica] -= work

    def _least_loaded(self) -> int:
        """The least-loaded replica; of equals, the one whose tree holds least (the most
        cache room for a new prefix)."""
        return min(self.live, key=lambda i: (self.load[i], len(self.trees[i]), i))

    def _choose(self, token_ids: Sequence[int], chain: list[int] | None) -> int:
        if not self.live:
            raise RuntimeError("no replica left to route to")
        if self.policy == "round_robin":
            return next(i for i in self._turn if i in self.live)
        if self.policy == "least_loaded" or len(self.live) == 1:
            return self._least_loaded()
        if chain is None:
            chain = self.trees[0].chain(token_ids)
        busiest = max(self.load[i] for i in self.live)
        idlest = min(self.load[i] for i in self.live)
        if busiest > BALANCE_ABS and busiest > BALANCE_REL * idlest:
            target = self._least_loaded()
        else:
            matched = [t.match(chain) for t in self.trees]
            best = max(self.live, key=lambda i: (matched[i], -self.load[i], -i))
            share = matched[best] * self.trees[0].block_size / max(len(token_ids), 1)
            if share >= CACHE_THRESHOLD:
                target = best
                self.num_cache_routed += 1
            else:
                target = self._least_loaded()
        self.trees[target].insert(chain)
        return target
