"""Checkpoint tensors as sharded layers see them: lazily sliceable, checked for shape."""

from __future__ import annotations

from typing import Protocol

import torch


class LazyTensor(Protocol):
    """A checkpoint tensor that reads only the slice a rank asks for."""

    name: str
    shape: tuple[int, ...]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read tensor[..., start:start+length, ...] along `dim`."""
        ...

    def full(self) -> torch.Tensor:
        """Read the whole tensor."""
        ...


class InMemoryTensor:
    """A LazyTensor over a tensor already in memory (tests, converted weights)."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name = name
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)

    def full(self) -> torch.Tensor:
        return self.tensor


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape doesn't match the model's config."""


def check_shape(loaded: LazyTensor, expected: tuple[int, ...]) -> None:
    """Raise WeightShapeError naming the tensor when its global shape is not `expected`."""
    if tuple(loaded.shape) != tuple(expected):
        raise WeightShapeError(
            f"tensor {loaded.name!r} has shape {list(loaded.shape)}, "
            f"expected {list(expected)} from the model config"
        )


def default_weight_loader(param: torch.nn.Parameter, loaded: LazyTensor,
                          shard_id: object = None) -> None:
    """Copy an unsharded tensor whole (norm weights, replicated biases)."""
    check_shape(loaded, tuple(param.shape))
    param.data.copy_(loaded.full())


def set_weight_loader(param: torch.nn.Parameter, loader: object) -> torch.nn.Parameter:
    """Attach the function that narrows a checkpoint tensor into `param`."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param
