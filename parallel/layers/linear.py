"""Tensor-parallel linear layers: sizes are global, each rank holds and loads its shard.

Weights are [out, in] as in PyTorch and Hugging Face checkpoints. Column-parallel
layers split `out`; row-parallel layers split `in` and AllReduce their output.
"""

from __future__ import annotations

import torch
from torch import nn

from meshserve.kernels.dispatch import linear
from meshserve.parallel.comm.tp_group import SINGLE, TensorParallelGroup
from meshserve.parallel.layers.weights import LazyTensor, check_shape, set_weight_loader


class _ParallelLinear(nn.Module):
    def __init__(self, in_local: int, out_local: int, bias: bool, tp: TensorParallelGroup,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.tp = tp
        self.weight = set_weight_loader(
            nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False),
            self.weight_loader)
        self.bias = None
        if bias:
            self.bias = set_weight_loader(
                nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False),
                self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinear):
    """y = x Aᵀ with A split by output rows; the output stays sharded."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False,
                 tp: TensorParallelGroup = SINGLE, dtype: torch.dtype | None = None) -> None:
        self.input_size, self.output_size = input_size, output_size
        self.out_local = tp.divide(output_size, "output_size")
        super().__init__(input_size, self.out_local, bias, tp, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None) -> None:
        expected = (self.output_size,) + tuple(param.shape[1:])
        check_shape(loaded, expected)
        param.data.copy_(loaded.narrow(0, self.tp.rank * self.out_local, self.out_local))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ weight^T + bias, in `out_dtype` (dispatch.linear; default x's dtype)."""
        return linear(x, self.weight, self.bias, out_dtype)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool = False,
                 tp: TensorParallelGroup = SINGLE, dtype: torch.dtype | None = None) -> None:
        self.output_sizes = list(output_sizes)
        self.local_sizes = [tp.divide(n, "output_size") for n in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias=bias, tp=tp, dtype=dtype)

    def weight_loader(self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int), shard_id
        size, local = self.output_sizes[shard_id], self.local_sizes[shard_id]
        check_shape(loaded, (size,) + tuple(param.shape[1:]))
        offset = sum(self.local_sizes[:shard_id])
        param.data.narrow(0, offset, local).copy_(loaded.narrow(0, self.tp.rank * local, local))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; heads split over ranks, KV heads replicated when
    the TP size exceeds their number."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, *,
                 bias: bool = False, tp: TensorParallelGroup = SINGLE,
                 dtype: torch.dtype | None = None) -> None:
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.num_local_heads = tp.divide(num_heads, "num_attention_heads")
        if tp.size <= num_kv_heads:
            self.num_local_kv_heads = tp.divide(num_kv_heads, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_local_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor-parallel size {tp.size} must divide or be a multiple "
                                 f"of num_key_value_heads={num_kv_heads}")
            self.num_local_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        self.q_local = self.num_local_heads * head_dim
        self.kv_local = self.num_local_kv_heads * head_dim
        # Skip ColumnParallelLinear's even split: the fused output is laid out q | k | v.
        _ParallelLinear.__init__(self, hidden_size, self.q_local + 2 * self.kv_local, bias, tp,
                                 dtype)
        self.input_size = hidden_size
        self.output_size = (num_heads + 2 * num_kv_heads) * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None) -> None:
        rest = tuple(param.shape[1:])
        if shard_id == "q":
            check_shape(loaded, (self.num_heads * self.head_dim,) + rest)
            src = loaded.narrow(0, self.tp.rank * self.q_local, self.q_local)
            param.data.narrow(0, 0, self.q_local).copy_(src)
            return
        assert shard_id in ("k", "v"), shard_id
        check_shape(loaded, (self.num_kv_heads * self.head_dim,) + rest)
        src = loaded.narrow(0, self.kv_head_start * self.head_dim, self.kv_local)
        offset = self.q_local + (0 if shard_id == "k" else self.kv_local)
        param.data.narrow(0, offset, self.kv_local).copy_(src)


class RowParallelLinear(_ParallelLinear):
    """y = x Aᵀ with A split by input columns; partial sums AllReduced in forward."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False,
                 tp: TensorParallelGroup = SINGLE, dtype: torch.dtype | None = None) -> None:
        self.input_size, self.output_size = input_size, output_size
        self.in_local = tp.divide(input_size, "input_size")
        super().__init__(self.in_local, output_size, bias, tp, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None) -> None:
        if param.dim() == 1:  # bias: replicated, added once after the reduction
            check_shape(loaded, (self.output_size,))
            param.data.copy_(loaded.full())
            return
        check_shape(loaded, (self.output_size, self.input_size))
        param.data.copy_(loaded.narrow(1, self.tp.rank * self.in_local, self.in_local))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The partial products all-reduced, plus the bias, in `out_dtype` (default x's)."""
        y = self.tp.all_reduce(linear(x, self.weight, out_dtype=out_dtype))
        return y if self.bias is None else y + self.bias
