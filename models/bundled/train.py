"""Train the bundled meshcoder target/draft pair on the Python standard library's source.

Run from a checkout as ``python models/bundled/train.py`` (a script beside the weights it
made, not installed with the package). Everything is offline and CPU-only:
the corpus is the running interpreter's own stdlib, the tokenizer is a byte-level BPE
trained here, and both models are Hugging Face ``LlamaForCausalLM`` trained in fp32 for
a wall-clock budget, then saved in bfloat16 in the Hugging Face layout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
MAX_POSITIONS = 1024
SEQ_LEN = 256
SKIP_DIRS = frozenset(
    {
        "site-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "encodings",
        "pydoc_data",
        "__pycache__",
    }
)
"""Directory names skipped anywhere under the stdlib: third-party packages, test suites,
the IDLE app, the deprecated 2to3 tool, generated codec tables and the generated pydoc
topic dump (the last two are data, not code)."""
HELDOUT_PERCENT = 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "# {{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}"
)
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n\nclass ")


def target_config() -> LlamaConfig:
    """Architecture of the bundled target model (~5.5M parameters)."""
    return _llama(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


def draft_config() -> LlamaConfig:
    """Architecture of the bundled draft model (~1/9 of the target)."""
    return _llama(
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
    )


def _llama(**sizes: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=0,
        architectures=["LlamaForCausalLM"],
        **sizes,
    )


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """The stdlib source split into train and held-out files."""

    root: Path
    """The stdlib directory the files came from."""
    train: list[str]
    """Train file texts, in sorted relative-path order."""
    heldout: list[str]
    """Held-out file texts (about HELDOUT_PERCENT of files, chosen by path hash)."""

    @property
    def num_bytes(self) -> int:
        """UTF-8 size of all files."""
        return sum(len(t.encode()) for t in self.train + self.heldout)


def collect_corpus() -> Corpus:
    """All stdlib ``*.py`` files outside SKIP_DIRS, split by a hash of the relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[str] = []
    heldout: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        bucket = int(hashlib.sha256(rel.as_posix().encode()).hexdigest(), 16) % 100
        (heldout if bucket < HELDOUT_PERCENT else train).append(text)
    return Corpus(root=root, train=train, heldout=heldout)


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE with EOT as id 0; encoding prepends EOT as the bos token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOT],
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOT) == 0 and tok.get_vocab_size() == VOCAB_SIZE
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, 0)]
    )
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One flat token stream: EOT before every file (so it also separates files)."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=True):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


def sample_windows(stream: torch.Tensor, batch_size: int, gen: torch.Generator) -> torch.Tensor:
    """A batch of random contiguous windows of SEQ_LEN tokens.  # [B, S]"""
    starts = torch.randint(0, stream.numel() - SEQ_LEN, (batch_size,), generator=gen)
    return torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()]).long()


def lr_at(step: int, progress: float, base_lr: float, warmup: int = 20) -> float:
    """Linear warmup over steps, then cosine to 10% driven by the elapsed budget fraction.

    Following wall-clock progress rather than an estimated step count keeps the decay
    ending exactly at the budget even when other jobs change the speed mid-run.
    """
    cosine = 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return base_lr * min(1.0, (step + 1) / warmup) * cosine


def batch_size_at(progress: float, batch_size: int) -> int:
    """Batch-size ramp: a quarter of ``batch_size`` for the first half of the budget, half
    until 80%, then all of it.

    At these losses small batches buy nearly the same loss drop per step at a fraction
    of the cost, and a 22-minute CPU run is step-starved: with ``batch_size`` throughout
    the target gets only ~400 steps and ends behind the 9x smaller draft.
    """
    if progress < 0.5:
        return max(1, batch_size // 4)
    return max(1, batch_size // 2) if progress < 0.8 else batch_size


def make_optimizer(model: LlamaForCausalLM, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_model(
    name: str,
    config: LlamaConfig,
    stream: torch.Tensor,
    *,
    minutes: float,
    lr: float,
    batch_size: int,
    seed: int,
) -> tuple[LlamaForCausalLM, dict[str, float]]:
    """Train one model for ``minutes`` of wall clock; returns it with its training stats."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().train()
    opt = make_optimizer(model, lr)
    gen = torch.Generator().manual_seed(seed)
    budget, start, step, tokens, recent = minutes * 60.0, time.perf_counter(), 0, 0, []
    while (elapsed := time.perf_counter() - start) < budget:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, elapsed / budget, lr)
        batch = sample_windows(stream, batch_size_at(elapsed / budget, batch_size), gen)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-20:]
        step, tokens = step + 1, tokens + batch.numel()
        if step % 10 == 0 or step == 1:
            print(
                f"[{name}] step {step:5d}  t={elapsed:7.1f}s  bs={len(batch):2d}  "
                f"lr={opt.param_groups[0]['lr']:.2e}  loss={loss.item():.4f}  "
                f"avg20={sum(recent) / len(recent):.4f}",
                flush=True,
            )
    stats = {
        "steps": step,
        "train_seconds": time.perf_counter() - start,
        "tokens_seen": tokens,
        "final_train_loss_avg20": sum(recent) / len(recent),
    }
    return model.eval(), stats


@torch.no_grad()
def eval_loss(model: LlamaForCausalLM, stream: torch.Tensor, max_windows: int = 256) -> float:
    """Mean next-token loss over non-overlapping SEQ_LEN windows of ``stream``."""
    num = min(max_windows, (stream.numel() - 1) // SEQ_LEN)
    windows = stream[: num * SEQ_LEN].view(num, SEQ_LEN).long()
    losses = [model(input_ids=w, labels=w).loss.item() for w in windows.split(16)]
    sizes = [len(w) for w in windows.split(16)]
    return sum(loss * n for loss, n in zip(losses, sizes, strict=True)) / num


@torch.no_grad()
def greedy(model: LlamaForCausalLM, prompt: torch.Tensor, num_new: int) -> torch.Tensor:
    """Greedy continuation of ``prompt`` [B, P] with the KV cache; ignores EOT. # [B, N]"""
    out = model(input_ids=prompt, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(num_new - 1):
        out = model(input_ids=tokens[-1], cache=out.cache, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def greedy_agreement(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    stream: torch.Tensor,
    num_prompts: int = 32,
    prompt_len: int = 64,
    num_new: int = 64,
) -> dict[str, float]:
    """How often the draft's greedy token matches the target's on target-generated text."""
    span = stream.numel() - prompt_len
    starts = [i * span // num_prompts for i in range(num_prompts)]
    prompts = torch.stack([stream[s : s + prompt_len] for s in starts]).long()  # [B, P]
    generated = greedy(target, prompts, num_new)  # [B, N]
    full = torch.cat([prompts, generated], dim=1)
    draft_pred = draft(input_ids=full[:, :-1]).logits[:, prompt_len - 1 :].argmax(-1)
    match = (draft_pred == generated).float()  # [B, N]
    k = 4
    # With greedy verification a k-token draft keeps its longest matching prefix.
    runs = torch.stack(
        [match[:, p : p + k].cumprod(dim=1).sum(dim=1) for p in range(num_new - k + 1)]
    )
    return {
        "agreement": match.mean().item(),
        "num_prompts": num_prompts,
        "prompt_len": prompt_len,
        "num_new": num_new,
        "mean_accepted_of_4": runs.mean().item(),
    }


def sample_completion(model: LlamaForCausalLM, tok: Tokenizer, prompt: str, n: int = 96) -> str:
    """Greedy completion of ``prompt`` (bos prepended), cut at the first EOT."""
    ids = torch.tensor([tok.encode(prompt).ids])
    new = greedy(model, ids, n)[0].tolist()
    if 0 in new:
        new = new[: new.index(0)]
    return prompt + tok.decode(new)


def save_model(model: LlamaForCausalLM, tok: Tokenizer, out_dir: Path) -> None:
    """Write the Hugging Face layout: bf16 safetensors, config, tokenizer, generation config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.float()
    config = json.loads((out_dir / "config.json").read_text())
    # Top-level legacy keys too, for loaders that predate transformers' rope_parameters.
    config.update(
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
        torch_dtype="bfloat16",
        rope_theta=10000.0,
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=0, eos_token_id=0, pad_token_id=0, do_sample=False, max_new_tokens=256
    ).save_pretrained(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def write_readme(report: dict, path: Path) -> None:
    """Human-readable summary of ``report`` next to the models."""
    c, t, d = report["corpus"], report["target"], report["draft"]
    lines = [
        "# Bundled meshcoder models",
        "",
        "`meshcoder/` (target) and `meshcoder-draft/` (draft for speculative decoding) are",
        "tiny `LlamaForCausalLM` models sharing one byte-level BPE tokenizer (vocab 4096,",
        f"`{EOT}` = id 0 as bos and eos), trained on CPU on the Python standard library's",
        "own source. Weights are stored in bfloat16; the chat template prepends bos.",
        "",
        "## Reproduce",
        "",
        "```",
        report["command"],
        "```",
        "",
        "## Training",
        "",
        *[f"- {k}: {v}" for k, v in report["training"].items()],
        "",
        "## Corpus",
        "",
        f"- Python {c['python_version']} stdlib at `{c['stdlib']}`",
        f"- skipped directories: {', '.join(c['skipped_dirs'])}",
        f"- {c['num_files']} files ({c['num_train_files']} train, {c['num_heldout_files']} "
        f"held out by sha256(relative path) % 100 < {HELDOUT_PERCENT}), {c['num_bytes']:,} bytes",
        f"- {c['num_train_tokens']:,} train tokens, {c['num_heldout_tokens']:,} held-out tokens",
        "",
        "## Models",
        "",
        "| | params | steps | tokens seen | train loss (last 20 steps) | train loss (eval) "
        "| held-out loss | size |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in (("target", t), ("draft", d)):
        lines.append(
            f"| {name} | {m['num_params']:,} | {m['steps']} | {m['tokens_seen']:,} "
            f"| {m['final_train_loss_avg20']:.3f} | {m['train_eval_loss']:.3f} "
            f"| {m['heldout_loss']:.3f} | {m['safetensors_bytes'] / 1e6:.1f} MB |"
        )
    a = report["agreement"]
    lines += [
        "",
        "## Target/draft greedy agreement",
        "",
        f"{a['agreement']:.3f} over {a['num_prompts']} held-out prompts of {a['prompt_len']} "
        f"tokens x {a['num_new']} target-greedy tokens (draft teacher-forced on the target's "
        f"prefix); mean accepted tokens per 4-token greedy draft: {a['mean_accepted_of_4']:.2f}.",
        "",
        "## Wall time (seconds)",
        "",
        *[f"- {k}: {v:.1f}" for k, v in report["phase_seconds"].items()],
        "",
        "## Sample greedy completions (target)",
        "",
    ]
    for sample in report["samples"]:
        lines += ["```python", sample, "```", ""]
    path.write_text("\n".join(lines))


def training_info(args: argparse.Namespace) -> dict[str, object]:
    """Hyperparameters and library versions, for the report."""
    import tokenizers
    import transformers

    return {
        "device": f"CPU, fp32, torch.set_num_threads(2) (host has {os.cpu_count()} cores)",
        "minutes_target": args.minutes_target,
        "minutes_draft": args.minutes_draft,
        "lr_target": args.lr_target,
        "lr_draft": args.lr_draft,
        "schedule": "20 linear warmup steps, then cosine to 10% over the wall-clock budget",
        "optimizer": "AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices, clip 1.0",
        "batch_size": args.batch_size,
        "batch_ramp": "batch_size/4 until 50% of the budget, batch_size/2 until 80%",
        "seq_len": SEQ_LEN,
        "seed": args.seed,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes-target", type=float, default=22.0)
    p.add_argument("--minutes-draft", type=float, default=6.0)
    p.add_argument("--lr-target", type=float, default=3e-3)
    p.add_argument("--lr-draft", type=float, default=5e-3)
    p.add_argument("--batch-size", type=int, default=16, help="batch size after the ramp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "bundled")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build corpus and tokenizer, train, evaluate and save both models with a report."""
    args = parse_args(argv)
    torch.set_num_threads(2)
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    corpus = collect_corpus()
    tok = train_tokenizer(corpus.train)
    train_stream = token_stream(tok, corpus.train)
    heldout_stream = token_stream(tok, corpus.heldout)
    phases["corpus_and_tokenizer"] = time.perf_counter() - t0
    print(
        f"corpus: {len(corpus.train)}+{len(corpus.heldout)} files, "
        f"{train_stream.numel():,}+{heldout_stream.numel():,} tokens",
        flush=True,
    )
    trained: dict[str, tuple[LlamaForCausalLM, dict]] = {}
    for name, config, minutes, lr in (
        ("target", target_config(), args.minutes_target, args.lr_target),
        ("draft", draft_config(), args.minutes_draft, args.lr_draft),
    ):
        t = time.perf_counter()
        trained[name] = train_model(
            name,
            config,
            train_stream,
            minutes=minutes,
            lr=lr,
            batch_size=args.batch_size,
            seed=args.seed,
        )
        phases[f"train_{name}"] = time.perf_counter() - t
    report = evaluate_and_save(args, corpus, tok, train_stream, heldout_stream, trained, phases)
    phases["total"] = time.perf_counter() - t0
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_readme(report, args.out / "README.md")
    print(json.dumps(report, indent=2), flush=True)


def evaluate_and_save(
    args: argparse.Namespace,
    corpus: Corpus,
    tok: Tokenizer,
    train_stream: torch.Tensor,
    heldout_stream: torch.Tensor,
    trained: dict[str, tuple[LlamaForCausalLM, dict]],
    phases: dict[str, float],
) -> dict:
    """Evaluate both models, measure agreement, save them; returns the report dict."""
    t = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed + 1)
    train_probe = sample_windows(train_stream, 64, gen).flatten()
    for model, stats in trained.values():
        stats["num_params"] = sum(p.numel() for p in model.parameters())
        stats["train_eval_loss"] = eval_loss(model, train_probe)
        stats["heldout_loss"] = eval_loss(model, heldout_stream)
    phases["eval"] = time.perf_counter() - t
    t = time.perf_counter()
    (target, _), (draft, _) = trained["target"], trained["draft"]
    agreement = greedy_agreement(target, draft, heldout_stream)
    samples = [sample_completion(target, tok, p) for p in SAMPLE_PROMPTS]
    phases["agreement_and_samples"] = time.perf_counter() - t
    t = time.perf_counter()
    for name, subdir in (("target", "meshcoder"), ("draft", "meshcoder-draft")):
        save_model(trained[name][0], tok, args.out / subdir)
        trained[name][1]["safetensors_bytes"] = (
            (args.out / subdir / "model.safetensors").stat().st_size
        )
    phases["save"] = time.perf_counter() - t
    corpus_info = {
        "python_version": sys.version.split()[0],
        "stdlib": str(corpus.root),
        "skipped_dirs": sorted(SKIP_DIRS),
        "num_files": len(corpus.train) + len(corpus.heldout),
        "num_train_files": len(corpus.train),
        "num_heldout_files": len(corpus.heldout),
        "num_bytes": corpus.num_bytes,
        "num_train_tokens": train_stream.numel(),
        "num_heldout_tokens": heldout_stream.numel(),
    }
    command = "python models/bundled/train.py " + shlex.join(sys.argv[1:])
    return {
        "command": command.strip(),
        "corpus": corpus_info,
        "training": training_info(args),
        "target": trained["target"][1],
        "draft": trained["draft"][1],
        "agreement": agreement,
        "samples": samples,
        "phase_seconds": phases,
    }


if __name__ == "__main__":
    main()
