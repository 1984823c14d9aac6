"""A run resolved once at start-up: the model's directory and architecture, the launch
environment, the device and a concrete layout, in one frozen object passed down.

Nothing below this reads config.json, looks at the launcher's environment or asks the
planner again: the engine, its executor and every rank's worker take a `Run`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from meshserve.engine.config.auto_layout import resolve_layout
from meshserve.engine.config.runtime_config import RuntimeConfig
from meshserve.kernels import dispatch
from meshserve.models.arch import ModelArch
from meshserve.models.bundled import resolve_draft_dir, resolve_model_dir
from meshserve.parallel.comm.discovery import LaunchEnv, discover
from meshserve.parallel.planner.search import resolve_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Run:
    """One run, resolved: every rank of it holds the same one but for `env`."""

    config: RuntimeConfig
    """The runtime configuration with concrete degrees (parallel.auto resolved)."""
    model_dir: Path
    """The model's Hugging Face directory."""
    arch: ModelArch
    """Its config.json, parsed and validated."""
    env: LaunchEnv | None
    """This process's launcher environment (torchrun, srun, mpirun, or a self-spawned
    rank's); None for a process started alone."""
    device_type: str
    """'cpu' or 'cuda': device=auto resolved."""
    draft_dir: Path | None = None
    """speculative.method=draft: the draft model's directory (its vocabulary checked)."""
    draft_arch: ModelArch | None = None
    """... and its config.json, parsed."""

    @property
    def world_size(self) -> int:
        """Ranks of this run's layout (one replica: tp x pp)."""
        return self.config.parallel.world_size

    def for_rank(self, env: LaunchEnv | None) -> Run:
        """The same run as seen by the rank whose environment is `env` (None: a rank this
        process spawns finds its own)."""
        return dataclasses.replace(self, env=env)

    def with_config(self, config: RuntimeConfig) -> Run:
        """The same model and environment under another configuration (a replica's)."""
        return dataclasses.replace(self, config=config)


def resolve_device(name: str) -> str:
    """'auto' picks CUDA when present; 'cuda' without a visible device is an error."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is visible: allowed are auto, cpu")
    return name


def resolve_run(config: RuntimeConfig, *, env: LaunchEnv | None | bool = True,
                max_dp: int | None = 1, announce: bool = True) -> Run:
    """Resolve `config` once: its model directory and architecture, the launch environment
    (`env=True` discovers it; pass one, or None for none), the device, and the layout
    (the planner's under parallel=auto, at most `max_dp` replicas; None: any)."""
    config = RuntimeConfig.of(config)
    launch_env = discover() if env is True else (env or None)
    model_dir = resolve_model_dir(config.model.name, config.model.path)
    arch = ModelArch.from_dir(model_dir)
    device_type = resolve_device(config.device)
    config = resolve_layout(config, arch, launch_env, device_type, announce=announce,
                            max_dp=max_dp)
    draft_dir, draft_arch = _resolve_draft(config, arch)
    return Run(config, model_dir, arch, launch_env, device_type, draft_dir, draft_arch)


def _resolve_draft(config: RuntimeConfig, arch: ModelArch) -> tuple[Path | None,
                                                                     ModelArch | None]:
    """The draft model of speculative.method=draft, checked against the target: the same
    vocabulary, and positions for the target's whole context."""
    spec = config.speculative
    if spec.method != "draft":
        return None, None
    m = config.model
    draft_dir = resolve_draft_dir(spec.draft_model, m.name, m.path)
    draft = ModelArch.from_dir(draft_dir)
    if draft.vocab_size != arch.vocab_size:
        raise ValueError(f"speculative.draft_model={spec.draft_model or draft_dir.name!r}: its "
                         f"vocabulary has {draft.vocab_size} tokens, the target's "
                         f"({m.path or m.name}) {arch.vocab_size}; allowed is a draft with the "
                         "target's vocabulary")
    limit = config.engine.max_model_len or arch.max_position_embeddings
    if draft.max_position_embeddings < limit:
        raise ValueError(f"speculative.draft_model={spec.draft_model or draft_dir.name!r}: "
                         f"{draft.max_position_embeddings} positions, fewer than the target's "
                         f"context of {limit}; allowed is a draft covering engine.max_model_len")
    if arch.sliding_window is not None or draft.sliding_window is not None:
        raise ValueError("speculative.method=draft with a sliding-window model: the draft's "
                         "KV follows the target's blocks, which that window releases; allowed:"
                         " speculative.method=ngram or none")
    return draft_dir, draft


def async_scheduling(run: Run) -> bool:
    """engine.async_scheduling for this run: schedule step n+1 while step n runs. It needs
    every step to be one step of the whole model (no pipeline: one rank, or one TP group
    whose driver shares the sampled tokens with the other ranks); null turns it on for
    one-rank CUDA runs (on a CPU there is nothing to overlap)."""
    asked = run.config.engine.async_scheduling
    pp = run.config.parallel.pp
    if asked and pp > 1:
        raise ValueError(f"engine.async_scheduling=true with parallel.pp={pp}: a pipeline "
                         "keeps micro-batches in flight instead; allowed are null, false")
    if asked is None:
        return run.device_type == "cuda" and run.world_size == 1
    return asked


def model_dtype(run: Run) -> str:
    """The run's model dtype (the planner's rule, resolve_dtype: auto is the checkpoint's
    dtype, but float32 on a CPU for anything other than bf16)."""
    return resolve_dtype(run.config.model.dtype, run.arch.dtype, run.device_type)


def compute_dtype(run: Run) -> torch.dtype:
    """The dtype the model's activations and its modules' tensors are in: the model dtype,
    except that a bf16 model on a CPU computes in fp32 around bf16 weights (cpu_weights)."""
    dtype = model_dtype(run)
    return torch.float32 if run.device_type == "cpu" and dtype == "bfloat16" else DTYPES[dtype]


def cpu_weights(run: Run, checkpoint_dtype: str | None = None) -> str:
    """What a CPU run's linear weights are held in (model.cpu_weight_dtype): as asked, or
    for auto bf16 where the model dtype is bf16 and the weights are packed panels (the C
    kernels built and on), else float32. `checkpoint_dtype`: another checkpoint's (a draft model's) instead of the
    run's."""
    mc = run.config.model
    if mc.cpu_weight_dtype != "auto":
        return mc.cpu_weight_dtype
    dtype = resolve_dtype(mc.dtype, checkpoint_dtype or run.arch.dtype, run.device_type)
    packed = mc.cpu_weight_layout in ("auto", "packed") and dispatch.native_enabled()
    return "bfloat16" if dtype == "bfloat16" and packed else "float32"


def cpu_bf16_batches(run: Run, checkpoint_dtype: str | None = None) -> bool:
    """Whether a CPU run's batched linears compute in bf16 (oneDNN, activations rounded):
    a bf16 model with bf16 weights. bf16 weights under an fp32 model keep fp32
    activations (model.cpu_weight_dtype=bfloat16 with model.dtype=float32)."""
    dtype = resolve_dtype(run.config.model.dtype, checkpoint_dtype or run.arch.dtype,
                          run.device_type)
    return (run.device_type == "cpu" and dtype == "bfloat16"
            and cpu_weights(run, checkpoint_dtype) == "bfloat16")


def kv_cache_dtype(run: Run) -> torch.dtype:
    """What the run's KV cache stores (engine.kv_cache_dtype; auto: the model dtype). A
    dtype other than the compute dtype is for CPU runs (GPU attention kernels read the
    model's dtype)."""
    asked = run.config.engine.kv_cache_dtype
    compute = compute_dtype(run)
    if asked == "auto":
        return DTYPES[model_dtype(run)]
    if DTYPES[asked] is compute:
        return compute
    if run.device_type != "cpu":
        raise ValueError(f"engine.kv_cache_dtype={asked} with a model computing in "
                         f"{str(compute).removeprefix('torch.')} on {run.device_type}: allowed "
                         "there are auto or the model's dtype (another cache dtype is for CPU "
                         "runs)")
    return DTYPES[asked]
