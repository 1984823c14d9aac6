"""Load a Hugging Face model directory: config, lazily read safetensors, tokenizer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from meshserve.kernels import dispatch
from meshserve.kernels.host_memory import to_huge_pages
from meshserve.models.arch import CheckpointError, ModelArch
from meshserve.models.llama import LlamaForCausalLM
from meshserve.parallel.comm.tp_group import SINGLE, TensorParallelGroup
from meshserve.parallel.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from meshserve.parallel.layers.weights import WeightShapeError

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsSlice:
    """A LazyTensor over one tensor of an open safetensors file: reads only what is asked."""

    def __init__(self, name: str, file: str, handle: object) -> None:
        self.name, self.file = name, file
        self._slice = handle.get_slice(name)  # type: ignore[attr-defined]
        self.shape = tuple(self._slice.get_shape())
        dtype = self._slice.get_dtype()
        if dtype not in _DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype}, unsupported "
                                  f"(supported: {', '.join(_DTYPES)})")

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._slice[:]


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: from model.safetensors.index.json, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: missing file (listed in {index.name})")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: missing file: no model.safetensors or "
                              "*.safetensors weights found")
    return files


def iter_checkpoint(files: list[Path], stack: ExitStack) -> Iterator[SafetensorsSlice]:
    """Every tensor of the checkpoint as a lazy slice (files stay open within `stack`)."""
    for f in files:
        try:
            handle = stack.enter_context(safe_open(str(f), framework="pt"))
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: cannot be read as safetensors ({e})") from None
        for name in handle.keys():
            yield SafetensorsSlice(name, str(f), handle)


def load_weights(model: LlamaForCausalLM, files: list[Path], progress: bool = True) -> None:
    """Fill every parameter of `model` (this rank's shards only) from the checkpoint."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = _expected_shards(model, params)
    loaded: set[tuple[str, object]] = set()
    total = sum(len(safe_open(str(f), framework="pt").keys()) for f in files)
    with ExitStack() as stack:
        bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress,
                   leave=False)
        for tensor in iter_checkpoint(files, stack):
            bar.update(1)
            target = _target(model, tensor.name)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                if _belongs_elsewhere(model, name):
                    continue
                raise CheckpointError(f"{tensor.file}: unexpected tensor {tensor.name!r} "
                                      "(no such parameter in the model)")
            param = params[name]
            try:
                param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
            except WeightShapeError as e:
                raise CheckpointError(f"{tensor.file}: {e}") from None
            loaded.add((name, shard))
        bar.close()
    missing = sorted(f"{n}" + (f" [{s}]" if s is not None else "")
                     for n, s in expected - loaded)
    if missing:
        raise CheckpointError(f"{files[0].parent}: missing tensor(s) for {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


_EXPERT = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
"""A per-expert tensor of a published MoE checkpoint -> the fused 3-D expert weights."""


def _target(model: LlamaForCausalLM, ckpt_name: str) -> tuple[str, object] | None:
    if ckpt_name.endswith(_IGNORED_SUFFIXES):
        return None
    expert = _EXPERT.match(ckpt_name)
    if expert:  # Mixtral names them w1 (gate), w3 (up), w2 (down), its block block_sparse_moe
        base, e, proj = f"{expert.group(1)}.mlp.experts", int(expert.group(2)), expert.group(3)
        if proj in ("down_proj", "w2"):
            return f"{base}.w2", e
        return f"{base}.w13", (e, 0 if proj in ("gate_proj", "w1") else 1)
    ckpt_name = ckpt_name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    if ckpt_name == "lm_head.weight" and model.arch.tie_word_embeddings:
        return None
    for src, (dst, shard) in model.packed_modules.items():
        if f".{src}." in ckpt_name:
            return ckpt_name.replace(f".{src}.", f".{dst}."), shard
    return ckpt_name, None


def _belongs_elsewhere(model: LlamaForCausalLM, name: str) -> bool:
    """A tensor of another pipeline stage (this rank skips it without reading it)."""
    parts = name.split(".")
    if name.startswith("model.layers.") and parts[2].isdigit():
        return not model.model.layer_start <= int(parts[2]) < model.model.layer_end
    return name.startswith(("model.embed_tokens.", "model.norm.", "lm_head."))


def _expected_shards(model: LlamaForCausalLM,
                     params: dict[str, torch.nn.Parameter]) -> set[tuple[str, object]]:
    out: set[tuple[str, object]] = set()
    for name in params:
        if name == "lm_head.weight" and model.arch.tie_word_embeddings:
            continue
        shards = getattr(params[name], "checkpoint_shards", None)
        if shards is not None:  # a parameter filled from several checkpoint tensors
            out.update((name, s) for s in shards)
        elif ".qkv_proj." in name:
            out.update((name, s) for s in ("q", "k", "v"))
        elif ".gate_up_proj." in name:
            out.update((name, s) for s in (0, 1))
        else:
            out.add((name, None))
    return out


def load_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32,
               tp: TensorParallelGroup = SINGLE, layer_range: tuple[int, int] | None = None,
               device: torch.device | str = "cpu", progress: bool = True,
               cpu_weight_layout: str = "auto", head_split: int | None = None,
               huge_pages: bool = True, arch: ModelArch | None = None,
               cpu_weight_dtype: str = "auto", bf16_batches: bool = False) -> LlamaForCausalLM:
    """Build the model for this rank (its TP shard, its PP layers) and load its weights
    (on CPU with cpu_weight_layout auto, linear weights are then packed for the C kernel
    where it runs, else wide ones go column-major; see ModelConfig.cpu_weight_layout; on
    CPU the weights then move to huge pages with `huge_pages`, host_memory.to_huge_pages;
    `cpu_weight_dtype` bfloat16 packs them as bf16, ModelConfig.cpu_weight_dtype; with
    `bf16_batches`, a bf16 model's batches take bf16 activations: dispatch.pack_weight).
    `arch`: the directory's config.json already parsed (else it is read here)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: missing model directory")
    arch = arch or ModelArch.from_dir(path)
    files = safetensors_files(path)
    with torch.device(device):
        model = LlamaForCausalLM(arch, tp=tp, dtype=dtype, layer_range=layer_range,
                                 head_split=head_split)
    load_weights(model, files, progress=progress)
    if torch.device(device).type == "cpu":
        if cpu_weight_layout in ("auto", "packed"):
            bf16 = cpu_weight_dtype == "bfloat16"
            pack_linear_weights(model, required=cpu_weight_layout == "packed" or bf16,
                                dtype=torch.bfloat16 if bf16 else torch.float32,
                                bf16_batches=bf16_batches)
        if cpu_weight_layout in ("auto", "column"):
            column_major_wide_weights(model)
        if huge_pages:
            to_huge_pages(model)
    return model.eval()


def _linear_weights(model: torch.nn.Module, tied: bool = False) -> list[torch.nn.Parameter]:
    """Every linear weight [N, K] of the model, once each (a packed one is
    [panels, K, PANEL]: not listed again); an LM head tied to the embedding only with
    `tied` (the embedding then gathers its rows from the head's layout)."""
    def is_embedding(m: torch.nn.Module) -> bool:
        return isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)

    heads = {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)}
    seen = {id(m.weight) for m in model.modules()
            if is_embedding(m) and not (tied and id(m.weight) in heads)}
    out = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.nn.Parameter) and w.dim() == 2 and id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def pack_linear_weights(model: torch.nn.Module, *, required: bool = False,
                        dtype: torch.dtype = torch.float32, bf16_batches: bool = False) -> int:
    """Repack every linear weight for the C packed kernel (dispatch.pack_weight) where it
    applies (fp32 on the CPU, the C kernels built), a head tied to the embedding too (the
    embedding gathers its rows from the panels: dispatch.embedding), as `dtype` panels;
    returns how many. `required`: raise ValueError naming model.cpu_weight_layout (and
    model.cpu_weight_dtype) where it does not apply."""
    weights = _linear_weights(model, tied=True)
    if not weights or not all(dispatch.packing_applies(w) for w in weights):
        if required and weights:
            raise ValueError(
                "model.cpu_weight_layout='packed' (and model.cpu_weight_dtype=bfloat16) need "
                "fp32 weights on the CPU and the C kernels (MESHSERVE_KERNELS=auto, a C "
                "compiler): allowed otherwise are cpu_weight_layout auto, column and row, "
                "cpu_weight_dtype auto and float32")
        return 0
    for w in weights:
        dispatch.pack_weight(w, dtype, bf16_batches)
    return len(weights)


def column_major_wide_weights(model: torch.nn.Module) -> int:
    """Store each untied linear weight [N, K] with N >= 2K column-major (same shape, the
    transpose's memory); returns how many were changed.

    On CPU, F.linear (MKL) with such weights runs faster for wide weights (the LM head,
    gate/up, qkv) at decode batch sizes; square and narrow weights (o_proj, down_proj) gain
    nothing and stay row-major (figures: docs/benchmarks/2026-11-30-cpu-2core.md). A weight shared with the
    embedding stays row-major: the embedding gathers its rows.
    """
    changed = 0
    for w in _linear_weights(model):
        if w.shape[0] >= 2 * w.shape[1]:
            w.data = w.data.t().contiguous().t()
            changed += 1
    return changed
