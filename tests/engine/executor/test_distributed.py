"""Tensor and pipeline parallel on CPU: gloo ranks spawned by `LLM(...)` itself.

One spawn per layout, several checks per spawn: greedy tokens identical to the
one-process run on a mixed-length batch under chunked prefill, prefix hits and forced
preemption; log-probabilities close to transformers; TP collectives per decode step as
theory says; every rank gone and the rendezvous port free after shutdown. Under async
scheduling a TP group's ranks feed their placeholders from the driver's broadcast tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.engine.core.outputs import RequestOutput

pytestmark = pytest.mark.slow

# 28 blocks of 4 tokens for ~300 prompt tokens: preemption is certain; 16-token budget:
# prompts are chunked.
ENGINE = ["parallel=single", "engine.block_size=4", "engine.num_gpu_blocks=28",
          "engine.max_num_batched_tokens=16", "parallel.timeout_s=60"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)

LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2-async": ["parallel.tp=2", "engine.async_scheduling=true"],  # tokens broadcast
    "tp4-kv-replicated": ["parallel.tp=4"],  # 2 KV heads, 4 ranks: each KV head on 2 ranks
    "pp2": ["parallel.pp=2"],
    "pp3-uneven": ["parallel.pp=3"],  # 5 layers: stages of 2, 2, 1
    "tp2-pp2": ["parallel.tp=2", "parallel.pp=2"],
}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("llama", num_hidden_layers=5)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    mixed = [torch.randint(0, 320, (n,), generator=gen).tolist()
             for n in (1, 3, 8, 15, 17, 31, 40, 57)]
    shared = mixed[-1][:24]  # two more prompts behind a 24-token common prefix
    return mixed + [shared + [5, 6, 7], shared + [9] * 11]


@pytest.fixture(scope="module")
def single(checkpoint: Path, prompts: list[list[int]]) -> list[RequestOutput]:
    return LLM(str(checkpoint), overrides=ENGINE, progress=False).generate(prompts, PARAMS)


def assert_close_to_transformers(hf: torch.nn.Module, prompts: list[list[int]],
                                 outs: list[RequestOutput]) -> None:
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            lp = hf(ids).logits[0, len(p) - 1:-1].log_softmax(-1)  # [generated, vocab]
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
        for i, (token, (chosen, top)) in enumerate(zip(o.token_ids, o.logprobs)):
            assert chosen == pytest.approx(lp[i, token].item(), abs=1e-4)
            want = lp[i].topk(3)
            assert [t for t, _ in top] == want.indices.tolist()
            assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)


def decode_step_counters(llm: LLM) -> list[dict[str, int]]:
    """TP collectives the driver issued in each decode step of a lone request."""
    engine = llm.engine
    counters = engine.executor.comm_counters  # type: ignore[attr-defined]
    engine.add_request([11, 12, 13], SamplingParams(max_tokens=4, ignore_eos=True))
    steps = []
    while engine.has_unfinished():
        before = counters.snapshot()
        engine.step()
        step = vars(counters - before)
        assert step.pop("comm_s") >= 0.0  # timed, so its value varies
        steps.append(step)
    return steps[-3:]  # the three decode steps (the prefill came first, maybe in chunks)


def not_listening(port: int) -> bool:
    """No socket listens on `port` any more (Linux: /proc/net/tcp, state 0A is LISTEN)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return not any(r[1].endswith(f":{port:04X}") and r[3] == "0A" for r in rows)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_process(checkpoint: Path, prompts: list[list[int]],
                                    single: list[RequestOutput], hf_reference,
                                    layout: str) -> None:
    llm = LLM(str(checkpoint), overrides=ENGINE + LAYOUTS[layout], progress=False)
    procs = llm.engine.executor.rank_processes  # type: ignore[attr-defined]
    port = llm.engine.executor.rendezvous_port  # type: ignore[attr-defined]
    try:
        outs = llm.generate(prompts, PARAMS)
        assert [o.token_ids for o in outs] == [o.token_ids for o in single]
        stats = llm.engine.stats
        assert stats.num_preemptions > 0
        assert stats.prefix_cache.num_hits + stats.prefix_cache.num_recompute_hits > 0
        assert stats.num_free_blocks == llm.engine.num_blocks
        assert_close_to_transformers(hf_reference(checkpoint), prompts, outs)
        ranks = llm.engine.executor.stage_stats()  # type: ignore[attr-defined]
        assert [r.rank for r in ranks] == list(range(llm.config.parallel.world_size))
        steps = ranks[0].num_micro_batches
        assert steps > 0 and all(r.num_micro_batches == steps for r in ranks)
        assert all(r.busy_s > 0 and r.input_wait_s >= 0 for r in ranks)
        # later stages wait for activations; in a pipeline the driver also waits, for the
        # last stage's tokens (or with a split LM head its logits); stage 0's other TP
        # ranks do not
        piped = llm.config.parallel.pp > 1
        assert all((r.input_wait_s > 0) == (r.pp_rank > 0 or (piped and r.rank == 0))
                   for r in ranks)
        assert llm.engine.executor.stage_stats()[-1].minus(ranks[-1]).num_micro_batches == 0  # type: ignore[attr-defined]

        tp, pp = llm.config.parallel.tp, llm.config.parallel.pp
        assert llm.engine.async_scheduling == ("async" in layout)
        if tp > 1 and not llm.engine.async_scheduling:  # the driver runs stage 0: two AllReduces per layer, one for the embedding
            num_layers = len(llm.engine.executor.worker.model.model.layers)  # type: ignore[attr-defined]
            num_ar = 2 * num_layers + 1
            expected = dict(num_all_reduce=num_ar, all_reduce_bytes=num_ar * 64 * 4,
                            num_gather=int(pp == 1), gather_bytes=int(pp == 1) * 320 // tp * 4)
            assert decode_step_counters(llm) == [expected] * 3
    finally:
        llm.shutdown()
    assert len(procs) == llm.config.parallel.world_size - 1
    assert all(p.poll() == 0 for p in procs.values())  # every rank exited cleanly
    assert not_listening(port)
