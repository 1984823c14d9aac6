"""The `meshserve` command: `meshserve <verb> [MODEL] [hydra overrides...]`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from meshserve.launch.cli_config import GROUPS, ConfigError, presets

VERBS: dict[str, tuple[str, str]] = {
    "generate": ("meshserve.launch.generate", "complete the configured prompts and print speed"),
    "serve": ("meshserve.launch.serve", "OpenAI-compatible HTTP server with Prometheus metrics"),
    "bench": ("meshserve.launch.bench", "run a benchmark workload on meshserve and its peers"),
    "plan": ("meshserve.launch.plan", "rank (tp, pp, dp) layouts for a model, cluster, scenario"),
    "diagnose": ("meshserve.launch.diagnose", "split step time by cause, name the bottleneck"),
    "calibrate": ("meshserve.launch.calibrate", "measure this machine and write a cluster preset"),
}


def _parser() -> argparse.ArgumentParser:
    groups = "\n".join(f"  {g:9s} {', '.join(presets(g))}" for g in GROUPS)
    p = argparse.ArgumentParser(
        prog="meshserve",
        description="LLM inference runtime: continuous batching over a paged KV cache, "
                    "laid out over GPUs and nodes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Configuration is Hydra: pick presets with group=name and override any key "
               "with key=value, e.g.\n  meshserve generate model=meshcoder "
               "engine.max_num_seqs=64 generate.max_tokens=32\n\nPresets:\n" + groups)
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    for verb, (_, help_text) in VERBS.items():
        sp = sub.add_parser(verb, help=help_text)
        sp.add_argument("-m", "--multirun", action="store_true",
                        help="sweep: run every combination of comma-separated values "
                             "(key=a,b), one process each, and summarize")
        sp.add_argument("overrides", nargs="*", help="a model directory or preset first "
                        "(optional), then Hydra overrides (key=value)")
    return p


def model_argument(args: list[str]) -> list[str]:
    """`meshserve serve DIR ...` as `vllm serve DIR`: a first argument without '=' names the
    model, a directory (kept as given: it is the name the server answers to) or a preset."""
    if not args or "=" in args[0]:
        return args
    model, rest = args[0], args[1:]
    if Path(model).expanduser().is_dir():
        return [f"model.path='{model}'", f"model.name='{Path(model).name}'", *rest]
    if model in presets("model"):
        return [f"model={model}", *rest]
    raise ConfigError(f"{model}: neither a model directory nor a model preset; allowed: a "
                      f"Hugging Face model directory, one of {', '.join(presets('model'))}, "
                      "or key=value overrides")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    module_name, _ = VERBS[args.verb]
    import importlib

    run: Callable[[list[str]], int] = importlib.import_module(module_name).run
    try:
        overrides = model_argument(list(args.overrides))
        if args.multirun:
            from meshserve.launch.sweep import run_sweep

            return run_sweep(args.verb, overrides)
        return run(overrides)
    except ConfigError as e:
        print(f"meshserve {args.verb}: config error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"meshserve {args.verb}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
