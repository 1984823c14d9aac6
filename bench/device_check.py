"""One prepared check of the GPU path on a lent machine: `python -m meshserve.bench.device_check
--out DIR [--smoke]`.

Sections (each on its own: a failure is recorded in the JSON and the rest still run):
kernel correctness against the references; HBM copy bandwidth; paged-decode attention
bandwidth against it (target >= 70%); decode tok/s at batch 1 and 64 of a random-weight
Llama-3-8B-shaped bf16 model against the roofline (batch-1 MBU target >= 75%) and
transformers; the longtail workload against transformers peers (target >= 3x); one
prompt's KV pulled between two processes over each KV wire the machine has (bench/
device_kv.py: torch over gloo and gloo pairs, NCCL with two GPUs, NIXL). Budget:
under 8 minutes on one H200. `--smoke` shrinks everything to seconds on a CPU, where the
Triton kernels run in the interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SECTIONS = ("kernels", "copy", "attention", "gemv", "decode", "longtail", "kv")


def sizes(smoke: bool, device: torch.device) -> Any:
    """The full run's sizes, or the smoke run's."""
    from meshserve.bench.device_sections import LLAMA3_8B, Sizes, decode_configs
    from meshserve.kernels.triton_paged_decode import DecodeConfig

    if not smoke:
        return Sizes(device=device, dtype=torch.bfloat16, copy_bytes=4 << 30, attn_batch=64,
                     attn_context=4096, model=LLAMA3_8B, decode_batches=(1, 64),
                     decode_prompt=512, decode_steps=64, longtail_checkpoint="big",
                     longtail_requests=64, peers=("hf-static-16", "hf-continuous"),
                     repeats=10, decode_sweep=decode_configs())
    tiny = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                max_position_embeddings=1024)
    return Sizes(device=device, dtype=torch.float32, copy_bytes=4 << 20, attn_batch=2,
                 attn_context=40, model=tiny, decode_batches=(1, 2), decode_prompt=20,
                 decode_steps=3, longtail_checkpoint="smoke", longtail_requests=2,
                 peers=("hf-static-2",), repeats=2,
                 decode_sweep=[DecodeConfig(tokens_per_iter=n) for n in (0, 32)],
                 kv_tokens=(64, 256), kv_rounds=2)


def run_sections(s: Any, out_dir: Path, only: tuple[str, ...], cache_dir: Path,
                 save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every section in order; a section's exception becomes its 'error' entry.

    `save` gets the results after each section, so a run stopped at its time limit keeps
    what it measured so far."""
    from meshserve.bench import device_decode as dd
    from meshserve.bench import device_gemv as dg
    from meshserve.bench import device_kv as dk
    from meshserve.bench import device_sections as ds

    results: dict[str, Any] = {}
    ds.warm_clocks(s.device)

    def copy_gbs() -> float:
        return float(results.get("copy", {}).get("gbs") or ds.copy_bandwidth(s)["gbs"])

    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "kernels": lambda: ds.kernel_correctness(s),
        "copy": lambda: ds.copy_bandwidth(s),
        "attention": lambda: ds.attention_bandwidth(s, copy_gbs()),
        "gemv": lambda: dg.gemv_sweep(s, copy_gbs()),
        "decode": lambda: dd.decode_throughput(s, copy_gbs()),
        "longtail": lambda: dd.longtail_throughput(s, str(cache_dir)),
        "kv": lambda: dk.kv_section(s),
    }
    for name in only:
        t0 = time.perf_counter()
        try:
            results[name] = steps[name]()
        except Exception as e:  # recorded, and the next section runs
            results[name] = {"error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc(limit=8)}
        results[name]["section_s"] = time.perf_counter() - t0
        print(f"[device_check] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save(results)
    return results


def table(results: dict[str, Any]) -> str:
    """One line per figure that has a target or a comparison."""
    rows = [("check", "value", "target", "")]

    def add(name: str, value: float | None, target: str, ok: bool | None) -> None:
        shown = "-" if value is None else f"{value:,.3g}"
        rows.append((name, shown, target, "" if ok is None else ("ok" if ok else "MISS")))

    for section, res in results.items():
        if "error" in res:
            rows.append((section, "ERROR", "", res["error"][:60]))
    k = results.get("kernels", {})
    if "ok" in k:
        worst = max(v for key, v in k.items() if key.endswith("_max_err"))
        add("kernels max |err|", worst, f"<= {k['tolerance']}", k["ok"])
    if "gbs" in results.get("copy", {}):
        add("HBM copy GB/s", results["copy"]["gbs"], "", None)
    a = results.get("attention", {})
    if "gbs" in a:
        add(f"paged decode GB/s ({a['kernel']})", a["gbs"], "", None)
        add("  fraction of copy", a["fraction_of_copy"], ">= 0.70",
            a["fraction_of_copy"] >= a["target"])
    if "tuned_gbs" in a:
        short = {"partition_tokens": "p", "tokens_per_iter": "t", "num_warps": "w",
                 "num_stages": "s"}
        cfg = " ".join(f"{short.get(k, k)}{v}" for k, v in a["tuned_config"].items())
        add(f"paged decode GB/s tuned ({cfg})", a["tuned_gbs"], "", None)
        add("  fraction of copy", a["tuned_fraction_of_copy"], ">= 0.70",
            a["tuned_fraction_of_copy"] >= a["target"])
    g = results.get("gemv", {})
    for key, d in g.get("shapes", {}).items():
        add(f"linear {key} cuBLAS GB/s", d["cublas_gbs"], "", None)
        if d["triton_gbs"] is not None:
            add(f"linear {key} Triton GB/s", d["triton_gbs"], "", None)
    if "rule" in g:
        rows.append(("  small-batch linear rule", str(g["rule"])[:60] if g["rule"] else "cuBLAS",
                     "", ""))
    for key, d in results.get("decode", {}).items():
        if key.startswith("batch") and isinstance(d, dict):
            mode = "async" if d.get("async_scheduling") else "sync"
            add(f"decode {key} tok/s (engine, {mode})", d["meshserve_tok_s"], "", None)
            if "sync_tok_s" in d:
                add(f"  {key} tok/s, async scheduling off", d["sync_tok_s"], "", None)
            add(f"  {key} MBU", d["mbu"], ">= 0.75" if key == "batch1" else "",
                d["mbu"] >= 0.75 if key == "batch1" else None)
            add(f"  {key} roofline tok/s", d["roofline_tok_s"], "", None)
            add(f"  {key} transformers tok/s", d["transformers_tok_s"], "", None)
            for part in ("roofline_step", "inputs", "packed_inputs", "graph_body",
                         "eager_body", "lm_head_argmax"):
                if f"{part}_ms" in d:
                    add(f"  {key} {part} ms", d[f"{part}_ms"], "", None)
    lt = results.get("longtail", {})
    for key, v in lt.items():
        if key.endswith("_tok_s"):
            add(f"longtail {key}", v, "", None)
        elif key.endswith("_error"):
            rows.append((f"longtail {key}", "ERROR", "", str(v)[:60]))
    if "speedup_vs_best_peer" in lt:
        add("  longtail speedup", lt["speedup_vs_best_peer"], ">= 3",
            lt["speedup_vs_best_peer"] >= 3.0)
    kv = results.get("kv", {})
    for wire, d in kv.items():
        if not isinstance(d, dict):
            continue
        if "skipped" in d or "error" in d:
            rows.append((f"KV pull {wire}", "skipped" if "skipped" in d else "ERROR", "",
                         d.get("skipped", d.get("error", ""))[:60]))
        for tokens in kv.get("tokens", []):
            if f"{tokens}_gbs" in d:
                add(f"KV pull {wire}, {tokens} tokens GB/s", d[f"{tokens}_gbs"], "", None)
                add(f"  {wire}, {tokens} tokens ms", d[f"{tokens}_ms"], "", None)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def environment(device: torch.device) -> dict[str, Any]:
    """What ran: versions and the device."""
    env: dict[str, Any] = {"torch": torch.__version__, "device": str(device),
                           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    """Run the check; exit 0 when it ran (targets missed are reported, not an exit code)."""
    p = argparse.ArgumentParser(prog="python -m meshserve.bench.device_check")
    p.add_argument("--out", required=True, help="folder for device_check.json")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on a CPU")
    p.add_argument("--cache-dir", default=None,
                   help="where the longtail checkpoint is built (default: OUT/checkpoints); "
                        "keep multi-GB checkpoints out of a folder that is copied back")
    p.add_argument("--no-decode-sweep", action="store_true",
                   help="keep the decode kernel's shipped launch (skip its sweep)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = p.parse_args(argv)
    only = tuple(x for x in args.sections.split(",") if x)
    unknown = [x for x in only if x not in SECTIONS]
    if unknown:
        p.error(f"--sections: {unknown} unknown; allowed are {SECTIONS}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        p.error("no CUDA device: the full check needs one (--smoke runs on a CPU)")
    if not cuda:  # before any Triton import: the kernels run in the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache_dir) if args.cache_dir else out / "checkpoints"
    t0 = time.perf_counter()

    def save(results: dict[str, Any]) -> dict[str, Any]:
        doc = {"environment": environment(device), "smoke": args.smoke,
               "total_s": time.perf_counter() - t0, "results": results}
        (out / "device_check.json").write_text(json.dumps(doc, indent=2, default=str))
        return doc

    s = sizes(args.smoke, device)
    if args.no_decode_sweep:
        s = dataclasses.replace(s, decode_sweep=[])
    results = run_sections(s, out, only, cache, save)
    doc = save(results)
    print(table(results))
    print(f"total {doc['total_s']:.0f} s; wrote {out / 'device_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
