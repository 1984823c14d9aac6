"""Hugging Face transformers peers on the same weights and token ids: greedy, EOS ignored.

`hf-static-<B>`: `model.generate` on batches of B requests in workload order, left padded
with an attention mask, each batch running until its longest request is done (as a user
of `generate` would run it). Only each request's own max_new_tokens count as generated;
a streamer stamps every decoding step, so a request's first token and its own last
token get the time at which they existed, even though the batch goes on after it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from meshserve.bench.harness import OnFinish, Runner
from meshserve.bench.hf_continuous import HFContinuousRunner
from meshserve.bench.metrics import RequestRecord, RunResult
from meshserve.bench.peer_names import HF_CONTINUOUS, static_batch_size
from meshserve.bench.workloads import BenchRequest

PAD_TOKEN_ID = 0
"""Pad id of the left padding; masked out, so any id works."""


def load_hf_model(model_dir: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers model of `model_dir`, set up for greedy decoding that ignores EOS."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    # generate() fills unset fields from model.generation_config (EOS included), so the
    # model's own must say "no EOS" as well, or EOS would stop rows early.
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None,
                                               pad_token_id=PAD_TOKEN_ID, bos_token_id=None)
    return model


def make_peer(name: str, model: torch.nn.Module, *, max_batch_tokens: int,
              kv_cache_memory: int) -> Runner:
    """The runner for a peer name (see bench/peer_names.py)."""
    if name == HF_CONTINUOUS:
        return HFContinuousRunner(model, max_batch_tokens=max_batch_tokens,
                                  kv_cache_memory=kv_cache_memory)
    batch_size = static_batch_size(name)
    if batch_size is None:
        raise ValueError(f"bench.peers: {name!r} is not a peer; allowed are hf-static-<B> "
                         f"and {HF_CONTINUOUS}")
    return HFStaticRunner(model, batch_size)


class TokenStamps:
    """A generate() streamer that stamps each put: the prompt, then one per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFStaticRunner:
    """transformers `model.generate` over static, left-padded batches of `batch_size`."""

    def __init__(self, model: torch.nn.Module, batch_size: int) -> None:
        self.model = model
        self.batch_size = batch_size
        self.name = f"hf-static-{batch_size}"

    def run(self, reqs: list[BenchRequest], on_finish: OnFinish | None = None) -> RunResult:
        """Batches in arrival order; a batch starts once its last request has arrived."""
        order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
        records: dict[int, RequestRecord] = {}
        computed = 0
        t0 = time.perf_counter()
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            ready = t0 + max(reqs[i].arrival_s for i in batch)
            time.sleep(max(0.0, ready - time.perf_counter()))
            records.update(self._run_batch([reqs[i] for i in batch], batch, t0))
            computed += len(batch) * max(reqs[i].max_new_tokens for i in batch)
            for _ in batch:
                if on_finish:
                    on_finish()
        recs = [records[i] for i in range(len(reqs))]
        wall = max(r.finish for r in recs) - min(r.arrival for r in recs)
        generated = sum(r.num_generated_tokens for r in recs)
        return RunResult(self.name, recs, wall, {"decoded_tokens": computed,
                                                 "padding_tokens": computed - generated})

    @torch.inference_mode()
    def _run_batch(self, batch: list[BenchRequest], indices: list[int], t0: float
                   ) -> dict[int, RequestRecord]:
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), width), PAD_TOKEN_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding: prompts end at the same column
            input_ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        clock = TokenStamps()
        out = self.model.generate(input_ids=input_ids, attention_mask=mask, streamer=clock,
                                  max_new_tokens=max(r.max_new_tokens for r in batch),
                                  do_sample=False)
        new = out[:, width:].tolist()  # [B, longest max_new_tokens]
        result = {}
        for row, (i, r) in enumerate(zip(indices, batch)):
            n = r.max_new_tokens
            assert len(new[row]) >= n, (len(new[row]), n)
            result[i] = RequestRecord(
                arrival=r.arrival_s, first_token=clock.times[1] - t0,
                finish=clock.times[n] - t0, num_prompt_tokens=len(r.prompt_token_ids),
                num_generated_tokens=n, token_ids=new[row][:n])
        return result
