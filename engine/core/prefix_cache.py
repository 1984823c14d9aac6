"""Prefix cache: full, computed KV blocks found again by the tokens they hold."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

ROOT_UID = 0
"""Parent id of a sequence's first block; never the id of a cached block."""

ROOT_HASH = 0
"""Parent hash of a sequence's first block."""


def hash_block(parent_hash: int, token_ids: Seq[int]) -> int:
    """Hash of one full block, chained from its parent block's hash."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass
class PrefixCacheStats:
    """Prefix-cache hit accounting, in tokens."""

    num_queries: int = 0
    """Prompt tokens looked up at first admission (short prompts included)."""

    num_hits: int = 0
    """Of `num_queries`, tokens served from the cache."""

    num_short_prompts: int = 0
    """Prompts shorter than one block, which can never hit."""

    num_recompute_queries: int = 0
    """Tokens looked up when a preempted sequence came back."""

    num_recompute_hits: int = 0
    """Of `num_recompute_queries`, tokens served from the cache."""

    num_evictions: int = 0
    """Cached blocks dropped to make room."""

    @property
    def hit_rate(self) -> float:
        """Hits over queries at first admission; 0.0 before any query."""
        return self.num_hits / self.num_queries if self.num_queries else 0.0


class PrefixCache:
    """Cached blocks keyed by (parent id, chained hash), and an LRU of the unused ones.

    A registration gets a fresh id (uid); a child block is keyed by its parent's uid, so
    a hit chain is exact: every block was computed after exactly the blocks before it.
    Token ids are compared on each hit, so a hash collision is a miss, never a wrong hit.
    A block whose parent was evicted becomes unreachable and waits in the LRU to be evicted.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.stats = PrefixCacheStats()
        self._block_of: dict[tuple[int, int], int] = {}
        self._key: list[tuple[int, int] | None] = [None] * num_blocks
        self._uid = [ROOT_UID] * num_blocks
        self._tokens: list[list[int] | None] = [None] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no sequence uses, least recently used first."""
        self._next_uid = ROOT_UID + 1

    @property
    def num_evictable(self) -> int:
        """Cached blocks that no sequence uses."""
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        """Whether `block` is registered."""
        return self._key[block] is not None

    def is_evictable(self, block: int) -> bool:
        """Whether `block` is cached and unused."""
        return block in self._evictable

    def uid_of(self, block: int) -> int:
        """Registration id of a cached block (ROOT_UID when not cached)."""
        return self._uid[block]

    def lookup(self, block_hashes: Seq[int], token_ids: Seq[int], max_blocks: int) -> list[int]:
        """Cached blocks holding the longest prefix of `token_ids`, at most `max_blocks`."""
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_UID
        for i in range(max_blocks):
            block = self._block_of.get((parent, block_hashes[i]))
            if block is None or self._tokens[block] != token_ids[i * bs:(i + 1) * bs]:
                break
            hits.append(block)
            parent = self._uid[block]
        return hits

    def register(self, block: int, parent_uid: int, block_hash: int, token_ids: list[int]) -> int:
        """Cache `block` (full, computed); return the uid now holding its content, 0 on collision.

        When identical content is cached already (computed twice), that block's uid is
        returned and `block` stays uncached.
        """
        key = (parent_uid, block_hash)
        other = self._block_of.get(key)
        if other is not None:
            return self._uid[other] if self._tokens[other] == token_ids else ROOT_UID
        assert self._key[block] is None, f"block {block} is cached already"
        uid = self._next_uid
        self._next_uid += 1
        self._block_of[key] = block
        self._key[block] = key
        self._uid[block] = uid
        self._tokens[block] = token_ids
        return uid

    def release(self, block: int) -> None:
        """The last user let go of cached `block`: it becomes the most recently used evictable."""
        self._evictable[block] = None

    def take(self, block: int) -> None:
        """A sequence starts using cached `block` again."""
        del self._evictable[block]

    def evict_lru(self) -> int | None:
        """Uncache the least recently used unused block and return it; None when there is none."""
        if not self._evictable:
            return None
        block, _ = self._evictable.popitem(last=False)
        self._forget(block)
        self.stats.num_evictions += 1
        return block

    def evict_all(self) -> list[int]:
        """Uncache every unused block; return them, least recently used first."""
        blocks = list(self._evictable)
        self._evictable.clear()
        for block in blocks:
            self._forget(block)
        return blocks

    def _forget(self, block: int) -> None:
        key = self._key[block]
        assert key is not None
        del self._block_of[key]
        self._key[block] = None
        self._uid[block] = ROOT_UID
        self._tokens[block] = None

    def check_invariants(self) -> None:
        """Assert the index and the LRU agree (O(num_blocks); for tests)."""
        for key, block in self._block_of.items():
            assert self._key[block] == key and self._uid[block] != ROOT_UID
        cached = sum(key is not None for key in self._key)
        assert cached == len(self._block_of), (cached, len(self._block_of))
        assert all(self._key[b] is not None for b in self._evictable)
