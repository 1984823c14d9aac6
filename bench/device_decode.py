"""Device-check measurements of whole-model decode: meshserve vs roofline vs transformers."""

from __future__ import annotations

import gc
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from meshserve.bench import roofline
from meshserve.bench.device_sections import Sizes, sync
from meshserve.models.arch import ModelArch


class _Seq:
    """A ScheduledLike for ModelRunner.execute."""

    def __init__(self, seq_id: int, token_ids: list[int], start_pos: int,
                 block_table: list[int]) -> None:
        self.seq_id, self.token_ids, self.start_pos = seq_id, token_ids, start_pos
        self.block_table, self.sample, self.num_drafts = block_table, True, 0
        self.prompt_targets: list[int] | None = None


def _random_model(arch: ModelArch, s: Sizes) -> torch.nn.Module:
    from meshserve.models.llama import LlamaForCausalLM

    with torch.device(s.device):  # allocate on the device: 16 GB never passes the host
        model = LlamaForCausalLM(arch, dtype=s.dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.eval()


def _meshserve_decode(arch: ModelArch, s: Sizes, batch: int,
                      async_scheduling: bool | None = None) -> dict[str, Any]:
    """Decode tok/s of the engine itself (scheduler, async scheduling and CUDA graphs as a
    one-GPU run has them) over a random model: `batch` requests of `decode_prompt` random
    tokens, timed from when every request has its first token to when all have
    `decode_steps` more."""
    from meshserve.engine.config.run import resolve_run
    from meshserve.engine.config.runtime_config import load_runtime_config
    from meshserve.engine.core.sampling_params import SamplingParams
    from meshserve.engine.engine import Engine
    from meshserve.engine.executor.executor import InProcessExecutor

    bs = 16
    max_len = -(-(s.decode_prompt + s.decode_steps + 2) // 256) * 256
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(s.dtype, "float32")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(s.model))
        overrides = [f"model.path='{tmp}'", f"device={s.device.type}", f"model.dtype={dtype}",
                     "parallel=single", f"engine.max_num_seqs={batch}",
                     f"engine.max_model_len={max_len}", f"engine.block_size={bs}",
                     f"engine.num_gpu_blocks={batch * (max_len // bs) + 8}",
                     "engine.async_scheduling="
                     + {None: "null", True: "true", False: "false"}[async_scheduling]]
        if s.device.type == "cpu":
            overrides.append("threads=1")
        config = load_runtime_config(overrides)
        run_ = resolve_run(config, env=None)
        executor = InProcessExecutor(run_, progress=False, model=_random_model(arch, s))
        engine = Engine(run_, progress=False, executor=executor)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, arch.vocab_size, (batch, s.decode_prompt), generator=gen)

        def run(max_tokens: int) -> tuple[float, int]:
            """Seconds and tokens from every request's first token to the end."""
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for p in prompts.tolist():
                engine.add_request(p, params)
            started: set[str] = set()
            t0, tokens = 0.0, 0
            while engine.has_unfinished():
                for o in engine.step():
                    if o.request_id in started:
                        tokens += len(o.new_token_ids)
                    else:
                        started.add(o.request_id)
                        if len(started) == batch:
                            sync(s.device)
                            t0 = time.perf_counter()
            sync(s.device)
            return time.perf_counter() - t0, tokens

        run(3)  # warm: the prefill kernels at this length, cuBLAS's choices
        seconds, tokens = run(s.decode_steps + 1)
        runner = executor.runner
        per_seq = max_len // bs
        seqs = [_Seq(i, [1], s.decode_prompt + s.decode_steps,
                     list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)]
        parts = _step_parts(runner, seqs, s)
        res = {"step_s": seconds * batch / tokens, "tok_s": tokens / seconds,
               "mean_context": s.decode_prompt + s.decode_steps / 2,
               "async_scheduling": engine.async_scheduling,
               "graphs": runner.graphs is not None, "max_model_len": max_len, **parts}
        engine.shutdown()
    return res


def _step_parts(runner: Any, seqs: list[_Seq], s: Sizes) -> dict[str, Any]:
    """Where a decode step's time goes: host input building, the model body (graph replay,
    and eager for comparison), the LM head with argmax, and one eager step's GPU kernels
    by name (the profiler cannot see inside a graph)."""
    from meshserve.engine.worker.cuda_graphs import bucket_for
    from meshserve.engine.worker.step_inputs import build_step_inputs
    from meshserve.parallel.planner.calibration import best_time

    inputs = build_step_inputs(seqs, runner.block_size, s.device)
    parts: dict[str, Any] = {
        "inputs_ms": best_time(lambda: build_step_inputs(seqs, runner.block_size, s.device),
                               s.repeats, s.device) * 1e3}
    hidden = runner._eager(inputs.input_ids, inputs.positions, inputs.meta)
    with torch.inference_mode():
        parts["lm_head_argmax_ms"] = best_time(
            lambda: runner.model.compute_logits(hidden).argmax(-1), s.repeats, s.device) * 1e3
        parts["eager_body_ms"] = best_time(
            lambda: runner._eager(inputs.input_ids, inputs.positions, inputs.meta), s.repeats,
            s.device) * 1e3
        if runner.graphs is not None:
            bucket = bucket_for(len(seqs), runner.graphs.sizes)
            graph, _ = runner.graphs.graphs[bucket]
            parts["graph_body_ms"] = best_time(graph.replay, s.repeats, s.device) * 1e3
            parts["packed_inputs_ms"] = best_time(
                lambda: runner.graphs.packed.send(seqs, runner.block_size, bucket), s.repeats,
                s.device) * 1e3
        parts["kernels"] = _kernel_table(
            lambda: runner._eager(inputs.input_ids, inputs.positions, inputs.meta), s.device)
    return parts


def _kernel_table(fn: Any, device: torch.device, top: int = 14) -> list[dict[str, Any]]:
    """GPU kernels (CPU: operators) of one call of `fn`, by self time: name, calls, us."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with torch.inference_mode(), profile(activities=[activity]) as prof:
        fn()
        sync(device)
    rows = []
    for e in prof.key_averages():
        if cuda:
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
        else:
            us = e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key[:90], "calls": e.count, "us": float(us)})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    return [{"name": "(all kernels)", "calls": sum(r["calls"] for r in rows), "us": total},
            *rows[:top]]


def _hf_decode(s: Sizes, batch: int) -> dict[str, Any]:
    """transformers generate: (time for 1 + n new tokens - time for 1) / n per step."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in s.model.items() if k != "architectures"}
    with torch.device(s.device):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(s.dtype).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (batch, s.decode_prompt), generator=gen)
    ids = ids.to(s.device)

    def run(n: int) -> float:
        conf = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                eos_token_id=None, pad_token_id=0)
        sync(s.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=conf)
        sync(s.device)
        return time.perf_counter() - t0

    run(2)  # warm
    step_s = (run(1 + s.decode_steps) - run(1)) / s.decode_steps
    return {"step_s": step_s, "tok_s": batch / step_s}


def decode_throughput(s: Sizes, copy_gbs: float) -> dict[str, Any]:
    """Decode tok/s at each batch: meshserve (graphs on CUDA), its MBU, roofline, transformers."""
    arch = ModelArch.from_hf_dict(s.model)
    itemsize = torch.empty((), dtype=s.dtype).element_size()
    res: dict[str, Any] = {"model": {k: s.model[k] for k in ("hidden_size", "num_hidden_layers",
                                                              "vocab_size")},
                           "dtype": str(s.dtype), "prompt": s.decode_prompt,
                           "steps": s.decode_steps, "mbu_target_batch1": 0.75}
    for batch in s.decode_batches:
        ours = _meshserve_decode(arch, s, batch)
        _free(s.device)
        if batch == 1 and ours["async_scheduling"]:  # what overlapping the host buys
            ours["sync_tok_s"] = _meshserve_decode(arch, s, batch, False)["tok_s"]
            _free(s.device)
        step_bytes = roofline.decode_bytes(arch, itemsize, batch * ours["mean_context"])
        roof_step = step_bytes / (copy_gbs * 1e9)
        hf = _hf_decode(s, batch)
        _free(s.device)
        res[f"batch{batch}"] = {
            "meshserve_tok_s": ours["tok_s"], "meshserve_step_ms": ours["step_s"] * 1e3,
            "mbu": roof_step / ours["step_s"], "roofline_tok_s": batch / roof_step,
            "transformers_tok_s": hf["tok_s"], "speedup_vs_transformers": ours["tok_s"]
            / hf["tok_s"], "roofline_step_ms": roof_step * 1e3,
            **{k: v for k, v in ours.items()
               if k.endswith("_ms") or k in ("kernels", "async_scheduling", "graphs",
                                             "max_model_len", "sync_tok_s")}}
    return res


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _InputsToDevice:
    """A transformers model whose generate() first moves its tensor arguments to `device`."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    def generate(self, **kwargs: Any) -> torch.Tensor:
        moved = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                 for k, v in kwargs.items()}
        generate = cast(Callable[..., torch.Tensor], self.model.generate)
        return generate(**moved)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def longtail_throughput(s: Sizes, cache_dir: str) -> dict[str, Any]:
    """The longtail workload: meshserve vs transformers peers, generated tokens per second.

    The checkpoint is built (or found) under `cache_dir`."""
    from meshserve.bench import checkpoints, workloads
    from meshserve.bench.harness import MeshserveRunner
    from meshserve.bench.peer_names import HF_CONTINUOUS
    from meshserve.bench.peers import load_hf_model, make_peer
    from meshserve.engine.config.runtime_config import load_runtime_config

    path = Path(cache_dir) / s.longtail_checkpoint
    if s.longtail_checkpoint in checkpoints.SPECS:
        path = checkpoints.resolve(s.longtail_checkpoint, path.parent)
    elif not (path / "config.json").is_file():  # the smoke run: the decode model's shape
        spec = {k: v for k, v in s.model.items() if k not in ("architectures", "dtype")}
        checkpoints.build(path, spec)
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(s.dtype, "float32")
    overrides = [f"model.path='{path}'", f"device={s.device.type}", f"model.dtype={dtype}"]
    if s.device.type == "cpu":
        overrides += ["threads=1", "engine.kv_cache_memory=67108864"]
    ours = MeshserveRunner(load_runtime_config(overrides))
    arch = ours.llm.engine.arch
    reqs = workloads.resolve("longtail", arch.vocab_size, num_requests=s.longtail_requests)
    warm = reqs[:4]  # Triton compiles, cuBLAS picks its kernels: outside the timed run
    ours.run(warm)
    results = {"meshserve": ours.run(reqs)}
    del ours
    _free(s.device)
    model = load_hf_model(path, s.dtype).to(s.device)
    res: dict[str, Any] = {"checkpoint": s.longtail_checkpoint, "requests": len(reqs),
                           "target_vs_best_peer": 3.0}
    for name in s.peers:
        static = name != HF_CONTINUOUS  # its generate() gets host tensors from the runner
        peer = make_peer(name, _InputsToDevice(model, s.device) if static else model,
                         max_batch_tokens=2048, kv_cache_memory=1 << 30)
        try:  # one peer failing (a transformers version without its API) spares the others
            peer.run(warm)
            results[name] = peer.run(reqs)
        except Exception as e:
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"
        _free(s.device)
    for name, r in results.items():
        res[f"{name}_tok_s"] = sum(x.num_generated_tokens for x in r.records) / r.wall_s
    peers = [res[f"{p}_tok_s"] for p in s.peers if p in results]
    if peers:
        res["speedup_vs_best_peer"] = res["meshserve_tok_s"] / max(peers)
    return res
