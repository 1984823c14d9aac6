"""Device-check section: decode-sized linear layers, cuBLAS against the Triton small-batch
kernel over a sweep of launches, timed inside CUDA graphs (from Python, launching these
small layers one by one is bound by the host, not the GPU). Where Triton is faster, the
section installs a rule (triton_gemv.RULES) for the rest of the process, so the decode
section measures the model with it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from meshserve.bench.device_sections import Sizes
from meshserve.parallel.planner.calibration import best_time

L2_BYTES = 64 << 20
"""Weights are rotated through copies totalling several times the L2 (60 MB on an H200)."""


def graph_time(calls: list[Callable[[], object]], device: torch.device, reps: int) -> float:
    """Seconds per call of `calls`, replayed `reps` times in one CUDA graph (best of 3);
    on a CPU, the best wall time per call."""
    if device.type != "cuda":
        return min(best_time(c, 2, device) for c in calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del graph
    return best / (reps * len(calls))


def gemv_configs(smoke: bool) -> list[Any]:
    """The Triton launches tried."""
    from meshserve.kernels.triton_gemv import GemvConfig

    if smoke:
        return [GemvConfig(block_n=16, block_k=64)]
    return [GemvConfig(block_n=n, block_k=k, num_warps=w, num_stages=st)
            for n in (16, 32, 64) for k in (256, 512) for w in (4, 8) for st in (3, 4)]


def layer_shapes(model: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(N, K) of each decoder linear layer of a Hugging Face Llama config at tp=1."""
    h, i = model["hidden_size"], model["intermediate_size"]
    d = h // model["num_attention_heads"]
    qkv = (model["num_attention_heads"] + 2 * model["num_key_value_heads"]) * d
    return {"qkv": (qkv, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}


def gemv_sweep(s: Sizes, copy_gbs: float) -> dict[str, Any]:
    """cuBLAS vs every Triton launch for each layer at 1 and 8 rows; installs a rule."""
    from meshserve.kernels import triton_gemv as tg

    smoke = s.device.type != "cuda"
    configs = gemv_configs(smoke)
    rows_tried = (1, 2) if smoke else (1, 8)
    reps = 2 if smoke else 10
    res: dict[str, Any] = {"shapes": {}, "copy_gbs": copy_gbs}
    best_by_shape: dict[str, dict[int, tuple[float, float, Any]]] = {}
    for name, (n, k) in layer_shapes(s.model).items():
        size = n * k * torch.empty((), dtype=s.dtype).element_size()
        copies = max(1, min(8, -(-4 * L2_BYTES // size)))
        weights = [torch.randn(n, k, device=s.device).to(s.dtype) for _ in range(copies)]
        best_by_shape[name] = {}
        for m in rows_tried:
            x = torch.randn(m, k, device=s.device).to(s.dtype)
            want = torch.nn.functional.linear(x, weights[0]).float()
            cublas = graph_time([lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in weights],
                                s.device, reps)
            tried = []
            for cfg in configs:
                try:
                    err = (tg.gemv(x, weights[0], None, cfg).float() - want).abs().max().item()
                    t = graph_time([lambda w=w, c=cfg, x=x: tg.gemv(x, w, None, c)
                                    for w in weights],
                                   s.device, reps)
                except Exception as e:  # a launch the compiler refuses
                    tried.append({**asdict(cfg), "error": f"{type(e).__name__}: {e}"[:160]})
                    continue
                tried.append({**asdict(cfg), "us": t * 1e6, "max_err": err})
            ok = [r for r in tried if "us" in r and r["max_err"] <= 0.05 * want.abs().max().item()]
            top = min(ok, key=lambda r: r["us"]) if ok else None
            cfg = tg.GemvConfig(**{f: top[f] for f in asdict(configs[0])}) if top else None
            best_by_shape[name][m] = (cublas, top["us"] / 1e6 if top else float("inf"), cfg)
            res["shapes"][f"{name}_m{m}"] = {
                "n": n, "k": k, "weight_bytes": size, "cublas_us": cublas * 1e6,
                "cublas_gbs": size / cublas / 1e9, "triton_us": top["us"] if top else None,
                "triton_gbs": size / (top["us"] / 1e6) / 1e9 if top else None,
                "triton_config": asdict(cfg) if cfg else None, "tried": tried}
        del weights
    rule = _rule(best_by_shape, layer_shapes(s.model), s.dtype)
    tg.RULES = [rule] if rule else []
    res["rule"] = asdict(rule) if rule else None
    return res


def _rule(best: dict[str, dict[int, tuple[float, float, Any]]],
          shapes: dict[str, tuple[int, int]], dtype: torch.dtype) -> Any:
    """One rule: Triton for the weights up to the largest size where it beats cuBLAS by 3%
    at every row count up to max_rows, and at every smaller size too; with the launch that
    was fastest for the largest of those weights at one row."""
    from meshserve.kernels import triton_gemv as tg

    item = torch.empty((), dtype=dtype).element_size()
    by_size = sorted(shapes, key=lambda name: shapes[name][0] * shapes[name][1])
    rows = sorted(next(iter(best.values())))
    for max_rows in reversed(rows):
        chosen: list[str] = []
        for name in by_size:
            if all(best[name][m][1] < 0.97 * best[name][m][0] for m in rows if m <= max_rows):
                chosen.append(name)
            else:
                break
        if chosen:
            cfg = best[chosen[-1]][rows[0]][2]  # the largest chosen weight's fastest launch
            size = shapes[chosen[-1]][0] * shapes[chosen[-1]][1] * item
            return tg.GemvRule(max_rows=max_rows, max_weight_bytes=size, config=cfg)
    return None
