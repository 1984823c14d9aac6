"""The device check's measurements: each takes a Sizes and returns a flat dict of figures."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.calibration import best_time

LLAMA3_8B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
    rms_norm_eps=1e-5, dtype="bfloat16")
"""Llama-3-8B's shape (random weights: nothing is downloaded)."""


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """How big each measurement is: the full GPU run, or the CPU smoke run."""

    device: torch.device
    dtype: torch.dtype
    copy_bytes: int
    """Bytes of the copy-bandwidth tensor."""
    attn_batch: int
    attn_context: int
    model: dict[str, Any]
    """The decode model's Hugging Face config dict."""
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_steps: int
    longtail_checkpoint: str
    """bench.checkpoints name for the longtail workload ('big' on GPU); any other name builds
    `model`'s shape under the output folder."""
    longtail_requests: int
    peers: tuple[str, ...]
    repeats: int
    decode_sweep: list[Any] = field(default_factory=list)
    """DecodeConfigs the attention section tries (Triton kernel); the fastest is kept."""
    kv_tokens: tuple[int, ...] = (1000, 4000)
    """Prompt lengths whose KV the kv section pulls from one process to another."""
    kv_rounds: int = 10


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_clocks(device: torch.device, seconds: float = 2.0) -> float:
    """Keep the GPU busy for `seconds` so its clocks are up before anything is timed (an
    idle H200 sits at 345 MHz; the first section's short kernels were timed 10% slow on
    the ramp). Returns the seconds spent; nothing to do on a CPU."""
    if device.type != "cuda":
        return 0.0
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        sync(device)
    return time.perf_counter() - t0


def copy_bandwidth(s: Sizes) -> dict[str, Any]:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    x = torch.empty(s.copy_bytes // 4, dtype=torch.float32, device=s.device).fill_(1.0)
    y = torch.empty_like(x)
    t = best_time(lambda: y.copy_(x), s.repeats, s.device)
    return {"bytes": s.copy_bytes, "seconds": t, "gbs": 2 * s.copy_bytes / t / 1e9}


def attention_bandwidth(s: Sizes, copy_gbs: float) -> dict[str, Any]:
    """Paged decode (the dispatcher's kernel) reading a full KV cache: GB/s and % of copy."""
    from meshserve.kernels import dispatch

    arch = ModelArch.from_hf_dict(s.model)
    h, hkv, d, bs = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, 16
    blocks_per_seq = -(-s.attn_context // bs)
    num_blocks = s.attn_batch * blocks_per_seq
    shape = (num_blocks, bs, hkv, d)
    k = torch.randn(shape, device=s.device).to(s.dtype)
    v = torch.randn(shape, device=s.device).to(s.dtype)
    perm = torch.randperm(num_blocks, device=s.device)
    tables = perm.view(s.attn_batch, blocks_per_seq)
    ctx = torch.full((s.attn_batch,), s.attn_context, device=s.device)
    q = torch.randn(s.attn_batch, h, d, device=s.device).to(s.dtype)
    t = best_time(lambda: dispatch.paged_decode(q, k, v, tables, ctx, d ** -0.5), s.repeats,
                  s.device)
    read = 2 * s.attn_batch * s.attn_context * hkv * d * k.element_size()
    gbs = read / t / 1e9
    res: dict[str, Any] = {
        "kernel": "triton" if dispatch.use_triton(s.device) else "reference",
        "batch": s.attn_batch, "context": s.attn_context, "kv_bytes": read, "seconds": t,
        "gbs": gbs, "fraction_of_copy": gbs / copy_gbs, "target": 0.70}
    if s.decode_sweep:
        res.update(_sweep_decode_configs(s, (q, k, v, tables, ctx, d ** -0.5), read, copy_gbs))
    return res


def decode_configs() -> list[Any]:
    """The launch configurations the device check tries for the decode kernel."""
    from meshserve.kernels.triton_paged_decode import DecodeConfig

    return [DecodeConfig(partition_tokens=p, tokens_per_iter=n, num_warps=w, num_stages=st)
            for p in (512, 1024) for n in (0, 32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]


def _sweep_decode_configs(s: Sizes, args: tuple[Any, ...], read: int,
                          copy_gbs: float) -> dict[str, Any]:
    """Time every decode_configs() entry on the same cache; the fastest correct one becomes
    the kernel's CONFIG for the rest of this process (the decode and longtail sections)."""
    from dataclasses import asdict

    from meshserve.kernels import triton_paged_decode as tpd

    default = tpd.CONFIG
    want = tpd.paged_decode(*args, config=default).float()
    tried = []
    for cfg in s.decode_sweep:
        try:
            err = (tpd.paged_decode(*args, config=cfg).float() - want).abs().max().item()
            t = best_time(lambda cfg=cfg: tpd.paged_decode(*args, config=cfg), s.repeats,
                          s.device)
        except Exception as e:  # a config the compiler refuses (shared memory, say)
            tried.append({**asdict(cfg), "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        tried.append({**asdict(cfg), "seconds": t, "gbs": read / t / 1e9, "max_err": err})
    ok = [r for r in tried if "gbs" in r and r["max_err"] <= 4e-2]
    best = max(ok, key=lambda r: r["gbs"])
    tpd.CONFIG = tpd.DecodeConfig(**{k: best[k] for k in asdict(default)})
    return {"tuned_config": {k: best[k] for k in asdict(default)}, "tuned_gbs": best["gbs"],
            "tuned_fraction_of_copy": best["gbs"] / copy_gbs, "sweep": tried}


def kernel_correctness(s: Sizes) -> dict[str, Any]:
    """Max |error| of each Triton kernel against its reference on this device."""
    from meshserve.kernels import paged_attention as ref
    from meshserve.kernels import triton_paged_decode as tpd
    from meshserve.kernels import triton_paged_prefill as tpp
    from meshserve.kernels import triton_rmsnorm as trn
    from meshserve.kernels import triton_rotary as trot
    from meshserve.kernels import triton_silu_mul as tsm
    from meshserve.kernels import triton_write_kv as twk

    dev, dt = s.device, s.dtype
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=dev, generator=gen).to(dt)

    k, v = rnd(24, 16, 2, 128), rnd(24, 16, 2, 128)
    tables = torch.randperm(24, device=dev)[:18].view(3, 6)
    ctx = torch.tensor([1, 40, 96], device=dev)
    q = rnd(3, 8, 128)
    errors = {"paged_decode": tpd.paged_decode(q, k, v, tables, ctx, 0.088, partition_tokens=32)
              .float() - ref.paged_decode(q.float(), k.float(), v.float(), tables, ctx, 0.088)}
    qp = rnd(40, 8, 128)
    out = tpp.paged_prefill(qp, k, v, tables[1:], torch.tensor([0, 20], device=dev),
                            torch.tensor([20, 20], device=dev),
                            torch.tensor([20, 76], device=dev), 20, 0.088)
    errors["paged_prefill"] = torch.cat([
        out[:20].float() - ref.paged_prefill(qp[:20].float(), k.float(), v.float(), tables[1],
                                             20, 0.088),
        out[20:].float() - ref.paged_prefill(qp[20:].float(), k.float(), v.float(),
                                             tables[2], 76, 0.088)])
    kc, vc, kr, vr = (torch.zeros_like(k) for _ in range(4))
    slots = torch.tensor([0, 17, 300, -1], device=dev)
    twk.write_kv(k[0, :4], v[0, :4], kc, vc, slots)
    ref.write_kv(k[0, :3], v[0, :3], kr, vr, slots[:3])
    errors["write_kv"] = torch.cat([kc - kr, vc - vr]).float()
    x, r, w = rnd(7, 4096), rnd(7, 4096), rnd(4096)
    errors["add_rms_norm"] = (trn.add_rms_norm(x, r, w, 1e-5)[0].float()
                              - trn.add_rms_norm_reference(x, r, w, 1e-5)[0].float())
    angles = torch.rand(7, 64, device=dev, generator=gen) * 6.3  # real cos/sin, |.| <= 1
    cos, sin = angles.cos(), angles.sin()
    qk = rnd(7, 12, 128)[:, :10]  # q and k heads of a fused QKV: a strided view
    errors["rotary"] = (trot.apply_rotary(qk, cos, sin).float()
                        - trot.apply_rotary_reference(qk.float(), cos, sin))
    gate_up = rnd(7, 2 * 4096)
    errors["silu_and_mul"] = (tsm.silu_and_mul(gate_up).float()  # rounded as PyTorch rounds
                              - tsm.silu_and_mul_reference(gate_up).float())
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 4e-2}[dt]
    res: dict[str, Any] = {"dtype": str(dt), "tolerance": tol}
    for name, e in errors.items():
        res[f"{name}_max_err"] = e.abs().max().item()
    res["ok"] = all(e.abs().max().item() <= tol for e in errors.values())
    return res
