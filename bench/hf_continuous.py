"""transformers' own continuous batching (paged attention) as a benchmark peer."""

from __future__ import annotations

import inspect
import logging
import time
from typing import TYPE_CHECKING

import torch

from meshserve.bench.harness import OnFinish
from meshserve.bench.metrics import RequestRecord, RunResult
from meshserve.bench.peer_names import HF_CONTINUOUS
from meshserve.bench.workloads import BenchRequest

if TYPE_CHECKING:
    from transformers.generation.continuous_batching import ContinuousBatchingManager
    from transformers.generation.continuous_batching.requests import GenerationOutput

NO_EOS = -1
"""transformers' continuous batching treats negative EOS ids as none."""

POLL_S = 0.05
"""Longest wait for a result before checking arrivals and the generation thread again."""

PAGE_SIZE = 256
"""Tokens per KV block (ContinuousBatchingConfig's default page)."""


def _page_size_field(config_cls: type) -> str:
    """'page_size' in recent transformers, 'block_size' before it was renamed (5.17)."""
    params = inspect.signature(config_cls).parameters
    return "page_size" if "page_size" in params else "block_size"


class _DropPsutilNotice(logging.Filter):
    """The cache size is given, so the CPU memory probe that wants psutil does not matter."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


class HFContinuousRunner:
    """`model.init_continuous_batching` + start / add_request / get_result / stop, per run.

    A fresh manager (and KV cache) per run, so no run finds the previous run's prefixes.
    The cache holds the whole workload, but at most meshserve's bytes (engine.kv_cache_memory).
    """

    name = HF_CONTINUOUS

    def __init__(self, model: torch.nn.Module, *, max_batch_tokens: int,
                 kv_cache_memory: int) -> None:
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.kv_cache_memory = kv_cache_memory
        logging.getLogger("ContinuousBatchingLogger").addFilter(_DropPsutilNotice())

    def _num_blocks(self, reqs: list[BenchRequest]) -> int:
        """Blocks for every request at once (no sharing), within kv_cache_memory bytes.

        Sized to the workload as a user would: with SDPA the attention mask spans the whole
        cache ([1, 1, batch tokens, cache tokens]), so a cache much larger than needed
        costs memory and time on every step.
        """
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * self.model.dtype.itemsize
        budget = self.kv_cache_memory // (per_token * PAGE_SIZE)
        need = sum(-(-(len(r.prompt_token_ids) + r.max_new_tokens) // PAGE_SIZE) for r in reqs)
        return max(1, min(budget, need))

    @torch.inference_mode()
    def run(self, reqs: list[BenchRequest], on_finish: OnFinish | None = None) -> RunResult:
        """Submit each request at its arrival from this thread; the manager decodes in its own."""
        from transformers import ContinuousBatchingConfig, GenerationConfig

        gen = GenerationConfig(do_sample=False, eos_token_id=NO_EOS, pad_token_id=0)
        cb = ContinuousBatchingConfig(max_batch_tokens=self.max_batch_tokens,
                                      num_blocks=self._num_blocks(reqs),
                                      **{_page_size_field(ContinuousBatchingConfig): PAGE_SIZE})
        manager = self.model.init_continuous_batching(generation_config=gen,
                                                      continuous_batching_config=cb)
        manager.start()
        try:
            results, t0 = self._drive(manager, reqs, on_finish)
        finally:
            manager.stop(block=True, timeout=60)
            manager.destroy()
        records = []
        for i, r in enumerate(reqs):
            res = results[f"r{i}"]
            stamps = res.timestamps or []
            if res.error is not None or len(res.generated_tokens) != r.max_new_tokens:
                raise RuntimeError(f"{self.name}: request {i} failed ({res.error}) or generated "
                                   f"{len(res.generated_tokens)} of {r.max_new_tokens} tokens")
            records.append(RequestRecord(
                arrival=r.arrival_s, first_token=stamps[0] - t0 if stamps else None,
                finish=(stamps[-1] if stamps else res.lifespan[1]) - t0,
                num_prompt_tokens=len(r.prompt_token_ids),
                num_generated_tokens=len(res.generated_tokens),
                token_ids=list(res.generated_tokens)))
        wall = max(x.finish for x in records) - min(x.arrival for x in records)
        return RunResult(self.name, records, wall, {"max_batch_tokens": self.max_batch_tokens,
                                                    "num_blocks": cb.num_blocks})

    def _drive(self, manager: ContinuousBatchingManager, reqs: list[BenchRequest],
               on_finish: OnFinish | None) -> tuple[dict[str, GenerationOutput], float]:
        order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
        results: dict[str, GenerationOutput] = {}
        nxt = 0
        t0 = time.perf_counter()
        while len(results) < len(reqs):
            while nxt < len(order) and t0 + reqs[order[nxt]].arrival_s <= time.perf_counter():
                r = reqs[order[nxt]]
                rid = manager.add_request(r.prompt_token_ids, request_id=f"r{order[nxt]}",
                                          max_new_tokens=r.max_new_tokens,
                                          record_timestamps=True, eos_token_id=NO_EOS)
                if rid is None:
                    raise RuntimeError(f"{self.name}: the manager refused request {order[nxt]}")
                nxt += 1
            wait = POLL_S
            if nxt < len(order):
                wait = min(wait, max(0.0, t0 + reqs[order[nxt]].arrival_s - time.perf_counter()))
            res = manager.get_result(timeout=wait) if wait > 0 else None
            if res is not None and res.is_finished():
                results[res.request_id] = res
                if on_finish:
                    on_finish()
            elif res is None and not manager.is_running():
                raise RuntimeError(f"{self.name}: the generation thread stopped with "
                                   f"{len(reqs) - len(results)} requests unfinished")
        return results, t0
