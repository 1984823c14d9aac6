"""Greedy tokens of this checkout against another commit's, per model and layout.

    python -m meshserve.bench.token_parity --base HEAD~1

A restructuring must not change a token. Each case (a model and a layout) generates the
same prompts greedily on both sides, in a fresh process each, the base commit checked
out as a git worktree and imported ahead of the installed checkout (as
`bench.against_commit` does); the tokens must be identical. Models: the bundled one and
two Hugging Face shapes built here (a Llama with GQA, a Qwen2 with biases). Layouts:
one rank, tp=2, pp=2, dp=2, prefill/decode 1+1, and speculative decoding by n-gram and
by a draft model. Prints one JSON line per case and writes them to OUT/parity.json;
exits 1 if any case differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from meshserve.bench.against_commit import ROOT, base_package, side_env

LAYOUTS: dict[str, list[str]] = {
    "single": ["parallel=single"],
    "tp2": ["parallel.tp=2", "parallel.pp=1", "parallel.dp=1"],
    "pp2": ["parallel.tp=1", "parallel.pp=2", "parallel.dp=1"],
    "dp2": ["parallel.tp=1", "parallel.pp=1", "parallel.dp=2"],
    "pd1+1": ["disagg=manual", "disagg.min_prefill_tokens=8"],
    "ngram": ["parallel=single", "speculative=ngram"],
    "draft": ["parallel=single", "speculative=draft"],
}
"""Each layout's overrides (on top of threads=1 and the model's own)."""

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                                num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=512)),
    "qwen2-bias": ("qwen2", dict(vocab_size=512, hidden_size=128, intermediate_size=224,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=512)),
}
"""The Hugging Face shapes: family and config."""

TEXT_PROMPTS = ["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n",
                "import os\n\nfor root, dirs, files in os.walk('.'):\n"]
ID_PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(20 + 5 * i)] for i in range(3)]
MAX_TOKENS = 24

GENERATE = """
import json, sys
from meshserve import LLM, SamplingParams
model, overrides, prompts, n = json.loads(sys.argv[1])
with LLM(model, overrides=overrides, progress=False) as llm:
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0,
                                                ignore_eos=True))
print("TOKENS " + json.dumps([o.token_ids for o in outs]))
"""


def build_shape(path: Path, family: str, config: dict[str, Any]) -> Path:
    """A random checkpoint of `family`, every weight scaled up so that greedy choices
    are far from ties (and biases given values, so bias handling counts)."""
    import torch
    import transformers

    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[family]
    config_cls, model_cls = (getattr(transformers, n) for n in names)
    torch.manual_seed(0)
    model = model_cls(config_cls(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


def generate(pythonpath: str | None, model: str, overrides: list[str],
             prompts: list[Any]) -> list[list[int]]:
    """One side's greedy tokens for `prompts`, in a process of its own."""
    env = side_env(pythonpath)
    arg = json.dumps([model, ["threads=1", *overrides], prompts, MAX_TOKENS])
    done = subprocess.run([sys.executable, "-c", GENERATE, arg], cwd=tempfile.gettempdir(),
                          env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    if done.returncode or not lines:
        raise SystemExit(f"{model} {overrides} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("TOKENS "):])


def cases(shapes_dir: Path) -> list[tuple[str, str, list[str], list[Any]]]:
    """(model name, model argument, its own overrides, prompts) of every model."""
    out: list[tuple[str, str, list[str], list[Any]]] = [
        ("meshcoder", "meshcoder", [], list(TEXT_PROMPTS))]
    for name, (family, config) in SHAPES.items():
        path = shapes_dir / name
        if not (path / "config.json").is_file():
            build_shape(path, family, config)
        # (no bundled draft: the model drafts for itself, which every draft accepts)
        out.append((name, str(path), [f"speculative.draft_model={path}"], ID_PROMPTS))
    return out


def compare(ours: list[list[int]], base: list[list[int]]) -> dict[str, Any]:
    """Whether two sides' tokens are identical, and where the first difference is."""
    for i, (a, b) in enumerate(zip(ours, base, strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"identical": False, "prompt": i, "first_difference": at}
    return {"identical": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--models", nargs="*", default=None,
                        help="meshcoder and/or " + ", ".join(SHAPES) + " (default: all)")
    parser.add_argument("--out", default="bench-results/token-parity")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pythonpath = base_package(args.base, Path(tmp))
        try:
            for name, model, own, prompts in cases(out / "shapes"):
                if args.models and name not in args.models:
                    continue
                for layout in args.layouts:
                    overrides = [*own, *LAYOUTS[layout]]
                    ours = generate(None, model, overrides, prompts)
                    base = generate(pythonpath, model, overrides, prompts)
                    rows.append({"model": name, "layout": layout, **compare(ours, base),
                                 "tokens": sum(map(len, ours))})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(Path(tmp) / "tree")], capture_output=True)
    (out / "parity.json").write_text(json.dumps(rows, indent=1))
    same = sum(r["identical"] for r in rows)
    print(f"{same} of {len(rows)} cases identical to {args.base}")
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
