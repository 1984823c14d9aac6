"""Paged KV cache bookkeeping: free pool, block tables, reference counts, prefix cache."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from meshserve.engine.core.pending_prefixes import PendingPrefixes
from meshserve.engine.core.prefix_cache import (
    ROOT_HASH,
    ROOT_UID,
    PrefixCache,
    PrefixCacheStats,
    hash_block,
)
from meshserve.engine.core.sequence import Sequence, SequenceStatus
from meshserve.validation import require

_NEVER = sys.maxsize
"""Registration progress of a sequence that met a hash collision: cache none of its blocks."""


class NoFreeBlocksError(RuntimeError):
    """A block was needed and none is free."""


@dataclass
class KVImport:
    """The blocks a prompt's KV arriving from another replica lands in: its full blocks
    this cache already holds (`cached`, not sent) and fresh ones for the rest (`blocks`,
    to be written), and with `tail` a fresh block for the tokens after the last full
    block, all pinned until `finish_import`."""

    token_ids: list[int]
    hashes: list[int]
    cached: list[int]
    blocks: list[int]
    tail: int | None = None

    @property
    def written(self) -> list[int]:
        """The blocks the transfer writes, in the prompt's order."""
        return self.blocks + ([self.tail] if self.tail is not None else [])

    @property
    def first_block(self) -> int:
        """Index in the prompt of the first block to send."""
        return len(self.cached)


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative ints."""
    return -(-a // b)


class BlockManager:
    """Fixed-size KV blocks shared by reference count, with an optional prefix cache.

    Every block is in exactly one place: used (ref count > 0), free and uncached (`_free`,
    handed out first, oldest first) or cached and unused (the prefix cache's LRU, evicted
    least recently used first). A sequence's blocks are freed tail first, so the tail of
    a prefix is evicted before its head. With prefix caching, the full blocks of a sequence's
    known tokens that it will compute are pending (see `PendingPrefixes`) from its admission
    until it registers them or frees its blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: attention reads only that many latest tokens, so blocks wholly
        behind every future query's window are given back (`release_behind_window`) or,
        at admission, never taken from the prefix cache."""
        require(num_blocks >= 1, "num_blocks", num_blocks, "an int >= 1")
        require(block_size >= 1, "block_size", block_size, "an int >= 1")
        require(sliding_window is None or sliding_window >= 1, "sliding_window",
                sliding_window, "null or an int >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.prefix_cache = PrefixCache(num_blocks, block_size) if enable_prefix_caching else None
        self.pending = PendingPrefixes() if enable_prefix_caching else None
        self._ref_count = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._progress: dict[int, list[int]] = {}
        """seq_id -> [leading blocks registered (or known cached), uid of the last of them]."""
        self._draft_valid = bytearray(num_blocks)
        """speculative.method=draft: 1 where the draft model's cache holds the KV of the
        block's tokens (its cache shares the target's block ids). Cleared when a block is
        taken for new tokens, set as the draft computes a full block: a prefix-cache hit
        or an import takes the draft's KV as valid only as far as these say."""
        self.num_kept_out = 0
        """Blocks never handed back: a failed transfer might still have been writing into
        them (`finish_import(keep_out=True)`)."""

    @property
    def stats(self) -> PrefixCacheStats:
        """Prefix-cache counters (all zero when prefix caching is off)."""
        return self.prefix_cache.stats if self.prefix_cache is not None else PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones plus unused cached ones."""
        cache = self.prefix_cache
        return len(self._free) + (cache.num_evictable if cache is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block: int) -> int:
        """How many block tables hold `block`."""
        return self._ref_count[block]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest prefix of `seq`'s tokens, leaving >= 1 token to compute."""
        if self.prefix_cache is None or seq.scores_prompt:  # its prompt is computed whole
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return []
        self._hash_blocks(seq, max_blocks)
        return self.prefix_cache.lookup(seq.block_hashes, seq.token_ids, max_blocks)

    def tail_rows(self, seq: Sequence, num_cached_blocks: int) -> int:
        """Tokens `seq.kv_tail` adds to a prefix of `num_cached_blocks` cached blocks: the
        rest of its tokens but the last, when those blocks are all the full blocks before
        them; else 0 (admission then drops the tail and its tokens are computed)."""
        if seq.kv_tail is None or self.sliding_window is not None:
            return 0
        num_before = seq.num_tokens - 1
        if num_cached_blocks != num_before // self.block_size:
            return 0
        return num_before % self.block_size

    def admit(self, seq: Sequence, cached_blocks: Seq[int], num_new_tokens: int) -> bool:
        """Give a blockless `seq` its cached blocks (and its `kv_tail`, see `tail_rows`)
        plus room for `num_new_tokens`; all or nothing."""
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        assert num_new_tokens >= 1
        num_tail = self.tail_rows(seq, len(cached_blocks))
        num_cached_tokens = len(cached_blocks) * self.block_size + num_tail
        assert num_cached_tokens + num_new_tokens <= seq.num_tokens
        num_needed = (cdiv(num_cached_tokens + num_new_tokens, self.block_size)
                      - len(cached_blocks) - (num_tail > 0))
        behind = self._num_behind_window(num_cached_tokens, len(cached_blocks))
        ref_count = self._ref_count
        num_reclaimed = sum(1 for b in cached_blocks[behind:] if ref_count[b] == 0)
        if num_needed > self.num_free_blocks - num_reclaimed:
            return False
        cache = self.prefix_cache
        for block in cached_blocks[behind:]:
            if ref_count[block] == 0:
                assert cache is not None
                cache.take(block)
            ref_count[block] += 1
        table = seq.block_table
        table.extend(cached_blocks)
        if seq.kv_tail is not None:  # its reference moves into the table, or goes
            if num_tail:
                table.append(seq.kv_tail)
            else:
                self._release(seq.kv_tail)
            seq.kv_tail = None
        self._grow(table, num_needed)
        for i in range(behind):  # read by no query: never taken, placeholders in the table
            table[i] = table[-1]
        seq.num_released_blocks = behind
        seq.num_computed_tokens = num_cached_tokens
        if cache is not None:
            last_uid = cache.uid_of(cached_blocks[-1]) if cached_blocks else ROOT_UID
            self._progress[seq.seq_id] = [len(cached_blocks), last_uid]
            self._record_lookup(cache.stats, seq, len(cached_blocks) * self.block_size)
            num_known_full = seq.num_tokens // self.block_size
            self._hash_blocks(seq, num_known_full)
            assert self.pending is not None
            self.pending.add(seq.seq_id, seq.block_hashes, len(cached_blocks), num_known_full)
        return True

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_new_tokens` more tokens; all or nothing."""
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        self._grow(seq.block_table, needed)
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s full blocks whose KV is computed and not yet cached."""
        cache = self.prefix_cache
        if cache is None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        progress = self._progress[seq.seq_id]
        start = progress[0]
        if start >= num_full:
            return
        self._hash_blocks(seq, num_full)
        bs, tokens, table, hashes = self.block_size, seq.token_ids, seq.block_table, seq.block_hashes
        uid = progress[1]
        pending = self.pending
        assert pending is not None
        for i in range(start, num_full):
            uid = cache.register(table[i], uid, hashes[i], tokens[i * bs:(i + 1) * bs])
            if uid == ROOT_UID:
                progress[0] = _NEVER
                pending.discard(seq.seq_id)
                return
        progress[0], progress[1] = num_full, uid
        pending.advance(seq.seq_id, num_full)

    def pending_block_hash(self, seq: Sequence, num_cached_blocks: int) -> int | None:
        """Hash of `seq`'s block after its `num_cached_blocks` cached ones if another sequence
        is computing that block now (so `seq` could hit it later); else None.

        Call after `find_cached_prefix(seq)`; only a block that lookup could return counts.
        """
        if self.pending is None or seq.scores_prompt:  # it takes no hit: waits for none
            return None
        if num_cached_blocks >= (seq.num_tokens - 1) // self.block_size:
            return None
        block_hash = seq.block_hashes[num_cached_blocks]
        return block_hash if block_hash in self.pending else None

    def is_pending(self, block_hash: int) -> bool:
        """Whether some sequence is computing a block with chained hash `block_hash`."""
        return self.pending is not None and block_hash in self.pending

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share `parent`'s full blocks with blockless `child`; copy the partial last block.

        Returns the (src, dst) block copy the model runner must do before the next step, or
        None. Raises NoFreeBlocksError when a copy is needed and no block is free.
        """
        assert not child.block_table and child.num_computed_tokens == parent.num_computed_tokens
        bs = self.block_size
        num_full = parent.num_computed_tokens // bs
        table = parent.block_table
        assert len(table) == cdiv(parent.num_computed_tokens, bs), "fork only between steps"
        copy = None
        if len(table) > num_full:
            if self.num_free_blocks == 0:
                raise NoFreeBlocksError(f"no free KV block to fork sequence {parent.seq_id}")
            copy = (table[num_full], self._take_block())
        for block in table[parent.num_released_blocks:num_full]:
            self._ref_count[block] += 1
        child.block_table = table[:num_full]
        child.num_released_blocks = min(parent.num_released_blocks, num_full)
        if copy is not None:
            child.block_table.append(copy[1])
        if self.prefix_cache is not None:
            self._progress[child.seq_id] = list(self._progress[parent.seq_id])
        return copy

    def _num_behind_window(self, next_pos: int, limit: int) -> int:
        """Leading blocks (at most `limit`) no query at `next_pos` or later reads: the
        earliest key such a query reads is next_pos - window + 1."""
        if self.sliding_window is None:
            return 0
        return max(0, min((next_pos - self.sliding_window + 1) // self.block_size, limit))

    def release_behind_window(self, seq: Sequence, next_pos: int) -> int:
        """Give back `seq`'s leading blocks wholly behind the sliding window of every query
        at `next_pos` or later; return how many went (0 without a window).

        Released entries stay in the table as placeholders (the last block's id: any block
        holds finite values, and attention masks those positions), so block i still covers
        positions i*bs.. . The last block is always kept; with prefix caching a block goes
        only once registered, so its hash stays findable until it is evicted."""
        table = seq.block_table
        n = self._num_behind_window(next_pos, len(table) - 1)
        progress = self._progress.get(seq.seq_id)
        if progress is not None and progress[0] != _NEVER:
            n = min(n, progress[0])
        done = seq.num_released_blocks
        if n <= done:
            return 0
        placeholder = table[-1]
        for i in range(n - 1, done - 1, -1):  # tail of the released run first
            self._release(table[i])
            table[i] = placeholder
        seq.num_released_blocks = n
        return n - done

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks, tail first, and a `kv_tail` it never took in; with
        `keep_tail`, a finish for its length keeps the block of its prompt's partial last
        block, in `kv_tail`."""
        keep = self._tail_to_keep(seq)
        if seq.kv_tail is not None:
            self._release(seq.kv_tail)
        for block in reversed(seq.block_table[seq.num_released_blocks:]):
            if block != keep:
                self._release(block)
        seq.kv_tail = keep
        seq.block_table.clear()
        seq.num_released_blocks = 0
        self._progress.pop(seq.seq_id, None)
        if self.pending is not None:
            self.pending.discard(seq.seq_id)

    def _tail_to_keep(self, seq: Sequence) -> int | None:
        n, bs = seq.num_prompt_tokens, self.block_size
        if (not seq.keep_tail or seq.status is not SequenceStatus.FINISHED_LENGTH
                or n % bs == 0 or seq.num_computed_tokens < n
                or not seq.num_released_blocks <= n // bs < len(seq.block_table)):
            return None
        return seq.block_table[n // bs]

    def begin_import(self, token_ids: list[int], *, tail: bool = False) -> KVImport | None:
        """Pin the cached full blocks of a prompt's prefix and take fresh blocks for its
        other full blocks (the last token is left to compute, as for a prefix hit), and with
        `tail` one for the tokens after them; None when too few blocks are free. No block of
        the import is reused before `finish_import`, whatever the transfer does."""
        cache = self.prefix_cache
        require(cache is not None, "engine.enable_prefix_caching", False,
                "true on a replica that receives KV")
        assert cache is not None
        n_full = (len(token_ids) - 1) // self.block_size
        hashes = self._prompt_hashes(token_ids, n_full)
        cached = cache.lookup(hashes, token_ids, n_full)
        num_reclaimed = sum(1 for b in cached if self._ref_count[b] == 0)
        if n_full - len(cached) + tail > self.num_free_blocks - num_reclaimed:
            return None
        self._pin(cached)
        fresh: list[int] = []
        self._grow(fresh, n_full - len(cached))
        return KVImport(list(token_ids), hashes, cached, fresh,
                        self._take_block() if tail else None)

    def add_import_tail(self, imp: KVImport) -> bool:
        """Take the tail block of an import begun without one (a streamed prompt's tail is
        known at its end); False when no block is free."""
        assert imp.tail is None
        if self.num_free_blocks < 1:
            return False
        imp.tail = self._take_block()
        return True

    def finish_import(self, imp: KVImport, *, written: bool, keep_out: bool = False
                      ) -> int | None:
        """Unpin an import's blocks. `written`: its fresh blocks hold the prompt's KV, so
        they enter the prefix cache (the prompt's admission finds them), and its tail
        block, still held, is returned for the sequence's `kv_tail`; else all are freed
        uncached. `keep_out` (not written): a transfer may still be writing into the
        fresh blocks and the tail, so they are never freed (`num_kept_out`)."""
        cache = self.prefix_cache
        assert cache is not None
        if keep_out and not written:
            fresh = imp.blocks + ([imp.tail] if imp.tail is not None else [])
            self.num_kept_out += len(fresh)
            imp.blocks, imp.tail = [], None
        if written:
            bs = self.block_size
            uid = cache.uid_of(imp.cached[-1]) if imp.cached else ROOT_UID
            for i, block in enumerate(imp.blocks, start=len(imp.cached)):
                uid = cache.register(block, uid, imp.hashes[i],
                                     imp.token_ids[i * bs:(i + 1) * bs])
                if uid == ROOT_UID:  # a hash collision: cache nothing after it
                    break
        tail, imp.tail = imp.tail, None
        if tail is not None and not written:
            self._release(tail)
        for block in reversed(imp.cached + imp.blocks):
            self._release(block)
        imp.cached, imp.blocks = [], []
        return tail if written else None

    def pin_prefix(self, token_ids: list[int]) -> list[int]:
        """Pin the cached full blocks of the longest cached prefix of `token_ids` (all but
        its last token), so nothing evicts them until `unpin`; the blocks, in order."""
        cache = self.prefix_cache
        if cache is None:
            return []
        n_full = (len(token_ids) - 1) // self.block_size
        blocks = cache.lookup(self._prompt_hashes(token_ids, n_full), token_ids, n_full)
        self._pin(blocks)
        return blocks

    def pin(self, blocks: Seq[int]) -> None:
        """Pin blocks in use (a prompt's, while it is read as it is computed), so they are
        not reused until `unpin`, whatever their sequence does meanwhile."""
        for block in blocks:
            assert self._ref_count[block] > 0, f"block {block} is not in use"
            self._ref_count[block] += 1

    def unpin(self, blocks: Seq[int]) -> None:
        """Release blocks pinned by `pin_prefix` (they stay cached, evictable)."""
        for block in reversed(blocks):
            self._release(block)

    def _prompt_hashes(self, token_ids: list[int], num_blocks: int) -> list[int]:
        hashes: list[int] = []
        parent, bs = ROOT_HASH, self.block_size
        for i in range(num_blocks):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    def _pin(self, cached: Seq[int]) -> None:
        assert self.prefix_cache is not None
        for block in cached:
            if self._ref_count[block] == 0:
                self.prefix_cache.take(block)
            self._ref_count[block] += 1

    def reset_prefix_cache(self) -> int:
        """Uncache every unused cached block; return how many were freed."""
        if self.prefix_cache is None:
            return 0
        blocks = self.prefix_cache.evict_all()
        self._free.extend(blocks)
        return len(blocks)

    def mark_draft_computed(self, seq: Sequence, before: int, after: int) -> None:
        """The draft model's KV of `seq` now reaches token `after` (from `before`): the
        full blocks it completed hold the draft's KV."""
        table = seq.block_table
        for i in range(max(before // self.block_size, seq.num_released_blocks),
                       min(after // self.block_size, len(table))):
            self._draft_valid[table[i]] = 1

    def draft_valid_tokens(self, seq: Sequence, num_tokens: int) -> int:
        """Of `seq`'s first `num_tokens` (held: a prefix hit, an import), those whose
        draft KV its blocks hold: whole blocks from the start, up to the first one the
        draft never computed (filled while drafting was priced out, by a request that
        does not draft, or read from another replica)."""
        n = 0
        for block in seq.block_table[:-(-num_tokens // self.block_size)]:
            if not self._draft_valid[block]:
                break
            n += self.block_size
        return min(n, num_tokens)

    def check_invariants(self) -> None:
        """Assert every block is in exactly one place (O(num_blocks); for tests)."""
        ref_count, cache = self._ref_count, self.prefix_cache
        assert all(r >= 0 for r in ref_count)
        assert len(set(self._free)) == len(self._free), "a block is free twice"
        for block in self._free:
            assert ref_count[block] == 0 and (cache is None or not cache.is_cached(block)), block
        num_unused = sum(r == 0 for r in ref_count)
        assert num_unused == self.num_free_blocks, (num_unused, self.num_free_blocks)
        if cache is not None:
            cache.check_invariants()
            assert self.pending is not None
            self.pending.check_invariants()
            for block in range(self.num_blocks):
                assert cache.is_evictable(block) == (ref_count[block] == 0
                                                     and cache.is_cached(block)), block

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Extend `seq.block_hashes` to its first `num_blocks` full blocks."""
        hashes, tokens, bs = seq.block_hashes, seq.token_ids, self.block_size
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)

    def _grow(self, table: list[int], num_blocks: int) -> None:
        for _ in range(num_blocks):
            table.append(self._take_block())

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            assert self.prefix_cache is not None
            evicted = self.prefix_cache.evict_lru()
            assert evicted is not None, "out of blocks: callers check num_free_blocks"
            block = evicted
        assert self._ref_count[block] == 0
        self._ref_count[block] = 1
        self._draft_valid[block] = 0
        return block

    def _release(self, block: int) -> None:
        count = self._ref_count[block] - 1
        assert count >= 0, f"block {block} freed twice"
        self._ref_count[block] = count
        if count == 0:
            if self.prefix_cache is not None and self.prefix_cache.is_cached(block):
                self.prefix_cache.release(block)
            else:
                self._free.append(block)

    def _record_lookup(self, stats: PrefixCacheStats, seq: Sequence, num_hit_tokens: int) -> None:
        if seq.num_preemptions:
            stats.num_recompute_queries += seq.num_tokens
            stats.num_recompute_hits += num_hit_tokens
            return
        stats.num_queries += seq.num_tokens
        stats.num_hits += num_hit_tokens
        stats.num_short_prompts += seq.num_tokens < self.block_size
        seq.num_cached_tokens = num_hit_tokens
