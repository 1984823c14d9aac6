"""The tensor-parallel group a sharded layer talks to, passed to it explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's place in its TP group; `group` is None when running unsharded."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        assert self.size >= 1 and 0 <= self.rank < self.size, (self.rank, self.size)
        assert self.size == 1 or self.group is not None, "a TP group of size > 1 needs a group"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place (no-op at size 1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (no-op at size 1)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def divide(self, n: int, what: str) -> int:
        """n / size, with a clear error when it doesn't divide."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {self.size}")
        return n // self.size


SINGLE = TensorParallelGroup()
