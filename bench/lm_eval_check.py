"""lm-evaluation-harness against `meshserve serve`, beside its transformers backend.

    python -m meshserve.bench.lm_eval_check [--items 60] [--out DIR]

Evaluation harnesses score text by log-likelihood: lm-evaluation-harness's
`local-completions` model sends each context + continuation to /v1/completions as token
ids with `echo: true, logprobs: 1, max_tokens: 1` and sums the continuation's prompt
log-probs. This runs a multiple-choice task from a local file (written here, so it runs
offline: Python snippets with one right continuation among four) through that model
against a `meshserve serve` of the bundled model, and through lm-eval's own `hf` backend
(transformers, fp32) on the same weights, in the same run, both told to begin each
request with BOS (`add_bos_token`: lm-eval's API models leave it out by default, its
transformers backend puts it in for this tokenizer). Prints one JSON line: each
side's accuracy and wall time, the largest log-likelihood difference over every
(item, choice) and whether every greedy flag agrees; writes it to OUT/lm_eval.json.
Needs `pip install lm_eval`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshserve.models.bundled import BUNDLED_DIR

MODEL = "meshcoder"
TASK = "meshcoder_snippets"
OPS = [("add", "+"), ("subtract", "-"), ("multiply", "*"), ("divide", "/"), ("power", "**"),
       ("modulo", "%")]
NAMES = ["a", "b", "x", "y", "left", "right", "first", "second", "n", "m"]


def snippet_items(count: int) -> list[dict[str, Any]]:
    """`count` multiple-choice items: a function's name says which operator it returns."""
    items = []
    for i in range(count):
        name, op = OPS[i % len(OPS)]
        a, b = NAMES[(2 * i) % len(NAMES)], NAMES[(2 * i + 1) % len(NAMES)]
        wrong = [o for _, o in OPS if o != op][i % 3:i % 3 + 3]
        choices = [f" {o} {b}" for o in [op, *wrong]]
        gold = i % 4  # the right one at a varying place
        choices[0], choices[gold] = choices[gold], choices[0]
        items.append({"context": f"def {name}({a}, {b}):\n    return {a}",
                      "choices": choices, "gold": gold})
    return items


TASK_YAML = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def write_task(root: Path, count: int) -> Path:
    """The task's data and YAML under `root`; returns the include path."""
    data = root / "snippets.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in snippet_items(count)))
    (root / f"{TASK}.yaml").write_text(TASK_YAML.replace("{data}", str(data)))
    return root


def start_server(threads: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "meshserve.launch.cli", "serve", f"model={MODEL}",
           "serve.port=0", "parallel=single", f"threads={threads}"]
    out = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"meshserve serve did not start:\n{log.read_text()[-2000:]}")


def evaluate(model: str, model_args: str, include: Path) -> tuple[dict[str, Any], float]:
    """lm-eval's simple_evaluate on the task: (results, wall seconds)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    res = simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                          task_manager=TaskManager(include_path=str(include)),
                          log_samples=True, batch_size=8)
    return res, time.perf_counter() - t0


def scores(res: dict[str, Any]) -> tuple[float, list[tuple[float, bool]]]:
    """Accuracy and every (item, choice)'s (log-likelihood, greedy) in doc order."""
    samples = sorted(res["samples"][TASK], key=lambda s: s["doc_id"])
    flat = [(float(r[0][0]), bool(r[0][1])) for s in samples for r in s["resps"]]
    return float(res["results"][TASK]["acc,none"]), flat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    tokenizer = BUNDLED_DIR / MODEL
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        include = write_task(root, args.items)
        proc, url = start_server(args.threads, root / "server.log")
        try:
            served, served_s = evaluate(
                "local-completions",
                f"model={MODEL},base_url={url}/v1/completions,tokenizer={tokenizer},"
                "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1,"
                "add_bos_token=True", include)
        finally:
            proc.terminate()
            proc.wait(30)
        import torch

        torch.set_num_threads(args.threads)
        hf, hf_s = evaluate("hf", f"pretrained={tokenizer},dtype=float32,device=cpu,"
                            "add_bos_token=True", include)
    acc, ours = scores(served)
    hf_acc, theirs = scores(hf)
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    line = {"task": TASK, "items": args.items, "choices": len(ours),
            "meshserve_acc": acc, "hf_acc": hf_acc,
            "max_abs_loglik_diff": max(abs(a[0] - b[0]) for a, b in zip(ours, theirs)),
            "greedy_flags_agree": all(a[1] == b[1] for a, b in zip(ours, theirs)),
            "meshserve_s": round(served_s, 2), "hf_s": round(hf_s, 2)}
    print(json.dumps(line))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lm_eval.json").write_text(json.dumps(line) + "\n")
    return 0 if line["max_abs_loglik_diff"] < 0.05 and line["greedy_flags_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
