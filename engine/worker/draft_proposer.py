"""Drafts from a small model beside the target (speculative.method=draft), on the rank that
samples, or in a pipeline on its driver (stage 0, which feeds the drafts).

The draft model has its own paged KV cache, with as many blocks as the target's and the
same block ids: a sequence's draft KV lives in the blocks of its target block table, so
the scheduler's allocation, copy-on-write and freeing serve both. Each step the draft
first runs, in one forward, the prompt chunks the target runs (its KV stays complete
for every prompt) and, for each speculating sequence, the tokens it lags by (it skips
plain decodes) and the sequence's last token (as decode rows where they are few). Then
k - 1 lean decode steps follow, one token per speculating sequence, with no scheduler work
in between (CUDA graphs on a GPU). On the CPU a fused draft model's greedy drafts run in
one C call (models/fused_decoder.py): the lean steps, and where every feed is decode rows
the first forward too.
Each draft token is picked under the request's own temperature, min-p, top-k and top-p,
from a generator of its own, and its distribution q goes to the rejection sampler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from meshserve.engine.config.run import Run, cpu_bf16_batches, cpu_weights, kv_cache_dtype
from meshserve.engine.core.sampling_params import SamplingParams, SequenceSampling
from meshserve.engine.core.scheduler_output import ScheduledSeq
from meshserve.engine.worker.kv_cache import allocate_kv_cache, bytes_per_block
from meshserve.engine.worker.model_runner import ModelRunner
from meshserve.engine.worker.sampling.sampler import Sampler
from meshserve.engine.worker.step_inputs import to_device
from meshserve.kernels import dispatch
from meshserve.models.attention import AttentionMetadata
from meshserve.models.fused_decoder import FusedDecoder
from meshserve.models.llama import LlamaForCausalLM
from meshserve.models.loader import load_model

DECODE_ROWS = 8
"""A drafting sequence lagging by fewer tokens than this feeds them, with its last one, as
decode rows (a verify step's layout: one CPU attention call, no prompt-chunk path); a
longer catch-up runs as a prompt chunk."""


@dataclass(slots=True)
class _Feed:
    """What the draft runs of one sequence in its first forward (a ScheduledLike)."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    num_drafts: int = 0
    prompt_targets: list[int] | None = None


@dataclass
class Drafts:
    """The step's scheduled sequences with their draft slots filled (a run that ended
    early fills fewer: the rest are not fed), and per speculating sequence its drafts and
    (sampled requests) their distributions [n, vocab]."""

    scheduled: list[ScheduledSeq]
    tokens: dict[int, list[int]]
    probs: dict[int, torch.Tensor]


class DraftProposer:
    """The draft model, its KV cache and its sampling state."""

    def __init__(self, run: Run, device: torch.device, dtype: torch.dtype,
                 model: LlamaForCausalLM | None = None) -> None:
        """`model`: weights already on the device (a test's, say) instead of the run's
        draft directory."""
        assert run.draft_dir is not None and run.draft_arch is not None, "method=draft"
        self.run, self.device, self.dtype = run, device, dtype
        self.kv_dtype = kv_cache_dtype(run)
        ec = run.config.engine
        self.model = model or load_model(
            run.draft_dir, dtype=dtype, device=device, progress=False,
            cpu_weight_layout=run.config.model.cpu_weight_layout, huge_pages=ec.cpu_huge_pages,
            cpu_weight_dtype=cpu_weights(run, run.draft_arch.dtype),
            bf16_batches=cpu_bf16_batches(run, run.draft_arch.dtype),
            arch=run.draft_arch)
        self.block_size = ec.block_size
        self.engine_seed = ec.seed
        self.stop_confidence = run.config.speculative.stop_confidence
        self.sampler = Sampler()
        self.runner: ModelRunner | None = None
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator | None] = {}
        self.num_forwards = 0
        """Forward passes of the draft model so far."""

    def block_bytes(self) -> int:
        """Bytes of one KV block of the draft's layers."""
        layers = self.model.attention_layers()
        return bytes_per_block(len(layers), layers[0].num_kv_heads, layers[0].head_dim,
                               self.block_size, self.kv_dtype)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate(self, num_blocks: int) -> None:
        """The draft's KV cache: `num_blocks` blocks, the target's count and ids."""
        layers = self.model.attention_layers()
        attn = layers[0]
        cache = allocate_kv_cache(len(layers), num_blocks, self.block_size, attn.num_kv_heads,
                                  attn.head_dim, self.kv_dtype, self.device,
                                  self.run.config.engine.cpu_huge_pages)
        self.runner = ModelRunner(self.model, cache, self.block_size, self.device)

    def track(self, new_seqs: Mapping[int, SequenceSampling], finished: Sequence[int]) -> None:
        for seq_id in finished:
            self.params.pop(seq_id, None)
            self.generators.pop(seq_id, None)
        for seq_id, seq in new_seqs.items():
            p = seq.params
            self.params[seq_id] = p
            gen = None
            if not p.greedy:  # its own stream, apart from the target's verification draws
                gen = torch.Generator(device=self.device)
                gen.manual_seed(hash((self.engine_seed, seq_id, "draft")) & (2**63 - 1))
            self.generators[seq_id] = gen

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        assert self.runner is not None
        self.runner.copy_blocks(copies)

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledSeq]) -> Drafts:
        """Run the draft's share of the step and fill every speculating sequence's draft
        slots."""
        runner = self.runner
        assert runner is not None, "allocate() first"
        feeds: list[_Feed] = []
        spec: dict[int, ScheduledSeq] = {}
        for s in scheduled:
            if s.draft_context is None:
                continue
            known = s.token_ids[:len(s.token_ids) - s.num_drafts]
            ctx = s.draft_context
            rows = len(ctx) if s.num_drafts and len(ctx) < DECODE_ROWS else 0
            feeds.append(_Feed(s.seq_id, [*ctx, *known], s.start_pos - len(ctx),
                               s.block_table, s.num_drafts > 0, rows))
            if s.num_drafts:
                spec[s.seq_id] = s
        if not feeds:
            return Drafts(scheduled, {}, {})
        if len(spec) == len(feeds):  # every feed drafts: maybe all of it in one C call
            tokens = self._greedy_in_one_call(feeds, [spec[f.seq_id] for f in feeds])
            if tokens is not None:
                return self._filled(scheduled, tokens, {})
        logits, seq_ids = runner.execute(feeds)
        self.num_forwards += 1
        if not spec:
            return Drafts(scheduled, {}, {})
        assert logits is not None  # (the draft runs whole on the rank that samples)
        last = [i for i, seq_id in enumerate(seq_ids)  # a feed of decode rows: its last
                if i + 1 == len(seq_ids) or seq_ids[i + 1] != seq_id]
        if len(last) < len(seq_ids):
            logits, seq_ids = logits[to_device(last, self.device)], [seq_ids[i] for i in last]
        tokens, probs = self._decode_loop(logits, [spec[i] for i in seq_ids])
        return self._filled(scheduled, tokens, probs)

    @staticmethod
    def _filled(scheduled: list[ScheduledSeq], tokens: dict[int, list[int]],
                probs: dict[int, torch.Tensor]) -> Drafts:
        """The step with each drafting sequence's slots holding its drafts."""
        filled = [dataclasses.replace(s, token_ids=[*s.token_ids[:-s.num_drafts],
                                                    *tokens[s.seq_id]],
                                      num_drafts=len(tokens[s.seq_id]))
                  if s.seq_id in tokens else s for s in scheduled]
        return Drafts(filled, tokens, probs)

    def _greedy_in_one_call(self, feeds: list[_Feed], seqs: list[ScheduledSeq]
                            ) -> dict[int, list[int]] | None:
        """Every draft of the step in one C call (models/fused_decoder.py), the catch-up
        rows included, where that gives what the modules would: a fused draft model with
        a packed head, every feed decode rows, every request greedy, no stop_confidence.
        None where it does not apply."""
        fused, head = self._fused_head(sum(len(f.token_ids) for f in feeds))
        if (fused is None or head is None
                or any(len(f.token_ids) != f.num_drafts + 1 for f in feeds)
                or not all(self.params[s.seq_id].greedy for s in seqs)):
            return None
        dev = self.device
        n = [s.num_drafts for s in seqs]
        k = max(n)
        drafted = torch.empty(len(feeds), k, dtype=torch.long, device=dev)
        fused.draft_greedy(
            head, drafted, to_device([f.start_pos for f in feeds], dev),
            self._tables(feeds), to_device(n, dev),
            to_device([t for f in feeds for t in f.token_ids], dev),
            to_device([len(f.token_ids) for f in feeds], dev))
        self.num_forwards += k  # the feed's forward, then k - 1 lean steps
        return _by_seq(drafted, seqs, n)

    def _tables(self, seqs: Sequence[_Feed] | Sequence[ScheduledSeq]) -> torch.Tensor:
        """The sequences' block tables [B, widest] on the device, padded with block 0."""
        width = max(len(s.block_table) for s in seqs)
        return to_device([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                         self.device)

    def _fused_head(self, rows: int) -> tuple[FusedDecoder | None, torch.Tensor | None]:
        """The fused draft model and its packed LM head, where greedy drafts of `rows` rows
        can run in one C call (no stop_confidence: it needs probabilities); else Nones."""
        runner, lm_head = self.runner, self.model.lm_head
        assert runner is not None
        fused = runner.fused
        if (fused is None or lm_head is None or self.stop_confidence > 0
                or not fused.drafts_greedy(lm_head.weight, lm_head.num_logits, rows)):
            return None, None
        return fused, lm_head.weight

    def _decode_loop(self, logits: torch.Tensor, seqs: list[ScheduledSeq]
                     ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """From the first draft logits of `seqs` (one row each), the rest of their drafts:
        each step feeds the token just drafted, for the sequences that want more; a
        sequence's run ends early at a draft of probability below stop_confidence."""
        runner = self.runner
        assert runner is not None
        dev, bs = self.device, self.block_size
        n = [s.num_drafts for s in seqs]
        k = max(n)
        params = [self.params[s.seq_id] for s in seqs]
        gens = [self.generators[s.seq_id] for s in seqs]
        tables = self._tables(seqs)
        base = to_device([s.start_pos for s in seqs], dev)  # the last known token's position
        drafted = torch.empty(len(seqs), k, dtype=torch.long, device=dev)
        sampled = not all(p.greedy for p in params)
        fused, head = self._fused_head(len(seqs)) if not sampled and k > 1 else (None, None)
        if fused is not None and head is not None:
            drafted[:, 0] = dispatch.argmax_rows(logits.float())  # the rest in one C call
            fused.draft_greedy(head, drafted, base, tables, to_device(n, dev))
            self.num_forwards += k - 1
            return _by_seq(drafted, seqs, n), {}
        q = torch.zeros(len(seqs), k, logits.shape[-1], device=dev) if sampled else None
        rows = list(range(len(seqs)))  # the sequences still drafting, as rows of `seqs`
        prev = base  # the first drafts replace it before anything reads it
        for j in range(k):
            if j:  # feed draft j - 1 at position base + j, for the rows that want draft j
                keep = [r for r, i in enumerate(rows) if n[i] > j]
                if len(keep) < len(rows):
                    kept = to_device(keep, dev)
                    base, tables, prev = (t.index_select(0, kept) for t in (base, tables, prev))
                    rows = [rows[r] for r in keep]
                pos = base + j
                slot = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1) * bs + pos % bs
                meta = AttentionMetadata(slot_mapping=slot, num_decode_tokens=len(rows),
                                         decode_block_tables=tables,
                                         decode_context_lens=pos + 1, prefills=[])
                hidden = runner.forward_tokens(prev, pos, meta)
                self.num_forwards += 1
                drafted_logits = self.model.compute_logits(hidden)
                assert drafted_logits is not None
                logits = drafted_logits
            prev, dist, conf = self._pick(logits.float(), [params[i] for i in rows],
                                          [gens[i] for i in rows])
            at: slice | torch.Tensor = (slice(None) if len(rows) == len(seqs)
                                        else to_device(rows, dev))
            drafted[at, j] = prev
            if q is not None and dist is not None:
                q[at, j] = dist
            if conf is not None and self.stop_confidence > 0 and j + 1 < k:
                for r in (conf < self.stop_confidence).nonzero().flatten().tolist():
                    n[rows[r]] = j + 1  # this draft ends its run
        tokens = _by_seq(drafted, seqs, n)
        probs = ({s.seq_id: q[i, :n[i]] for i, s in enumerate(seqs) if not params[i].greedy}
                 if q is not None else {})
        return tokens, probs

    def _pick(self, logits: torch.Tensor, params: list[SamplingParams],
              gens: list[torch.Generator | None]
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One draft token per row, the rows' distributions when any row samples, and the
        probability each row's token had (greedy rows: only where stop_confidence asks)."""
        if all(p.greedy for p in params):
            tok = dispatch.argmax_rows(logits)
            if self.stop_confidence <= 0:
                return tok, None, None
            top = logits.gather(1, tok.unsqueeze(1)).squeeze(1)
            return tok, None, (top - logits.logsumexp(dim=-1)).exp()
        probs = self.sampler.probs(logits, params)
        tok = self.sampler.draw(probs, logits, [p.greedy for p in params], gens)
        return tok, probs, probs.gather(1, tok.unsqueeze(1)).squeeze(1)


def _by_seq(drafted: torch.Tensor, seqs: Sequence[ScheduledSeq], n: list[int]
            ) -> dict[int, list[int]]:
    """Row i of drafted [B, k], its first n[i] drafts, under seqs[i]'s id."""
    host = drafted.tolist()
    return {s.seq_id: host[i][:n[i]] for i, s in enumerate(seqs)}
