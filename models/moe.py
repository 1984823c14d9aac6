"""A mixture-of-experts MLP: a router picks each token's top-k experts, SwiGLU experts held
as two 3-D weights compute the tokens routed to them, and the results are summed back with
the routing weights; a shared expert, where the model has one, adds its output behind a
sigmoid gate (the sparse blocks of Qwen3-MoE, Qwen2-MoE and Mixtral; one rank holds every
expert)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshserve.kernels.dispatch import linear
from meshserve.models.arch import ModelArch
from meshserve.parallel.layers.weights import LazyTensor, check_shape, set_weight_loader

Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""router(logits [T, E] fp32) -> (weights [T, k] fp32, expert ids [T, k] int64)."""


def softmax_top_k(k: int, renormalize: bool) -> Router:
    """The softmax over all experts, its k largest kept (renormalized to sum 1 with
    `renormalize`: Qwen3-MoE's norm_topk_prob)."""
    def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    return route


class FusedExperts(nn.Module):
    """`num_experts` SwiGLU experts as w13 [E, 2I, H] (each expert's gate rows, then its up
    rows) and w2 [E, H, I], loaded from the per-expert tensors published checkpoints hold
    (experts.<e>.gate_proj / up_proj / down_proj)."""

    def __init__(self, num_experts: int, hidden: int, inter: int,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype),
                               requires_grad=False)
        set_weight_loader(self.w13, self._load_w13)
        set_weight_loader(self.w2, self._load_w2)
        # the (name, shard) pairs the loader must see filled: one tensor per expert and half
        vars(self.w13)["checkpoint_shards"] = [(e, j) for e in range(num_experts) for j in (0, 1)]
        vars(self.w2)["checkpoint_shards"] = list(range(num_experts))

    def _load_w13(self, param: nn.Parameter, loaded: LazyTensor, shard: object) -> None:
        assert isinstance(shard, tuple)
        e, half = shard
        check_shape(loaded, (self.inter, self.hidden))
        param.data[e, half * self.inter:(half + 1) * self.inter].copy_(loaded.full())

    def _load_w2(self, param: nn.Parameter, loaded: LazyTensor, shard: object) -> None:
        assert isinstance(shard, int)
        check_shape(loaded, (self.hidden, self.inter))
        param.data[shard].copy_(loaded.full())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights and ids [T, k] -> sum_j weights[t, j] * expert_ids[t, j](x[t]).
        Tokens are grouped by expert (one sort), so each active expert's weights are read
        once per call whatever the batch."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // k  # the token of each (token, choice) in expert order
        xe = x.to(self.w13.dtype)  # the experts compute in their weights' dtype
        w = weights.reshape(-1)[order].to(xe.dtype)
        out = torch.zeros_like(xe)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = rows[start:start + n]
            gate_up = xe[tok] @ self.w13[e].t()
            h = nn.functional.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:]
            out.index_add_(0, tok, (h @ self.w2[e].t()) * w[start:start + n, None])
            start += n
        return out.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Router (a linear to one logit per expert, fp32 softmax, top-k), the experts, and an
    optional shared expert (any module taking (x, low), given at construction) weighed by
    sigmoid(shared_expert_gate . x)."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype | None,
                 shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = _Weight(arch.num_experts, arch.hidden_size, dtype)
        self.experts = FusedExperts(arch.num_experts, arch.hidden_size,
                                    arch.moe_intermediate_size, dtype)
        self.route = softmax_top_k(arch.num_experts_per_tok, arch.norm_topk_prob)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = _Weight(1, arch.hidden_size, dtype)

    def forward(self, x: torch.Tensor, low: torch.dtype | None = None) -> torch.Tensor:
        """The block's output for x [T, H], in x's dtype (`low`: the dtype the shared
        expert's linears compute in, as the dense MLP's; the routed experts compute in
        their weights' dtype)."""
        logits = linear(x, self.gate.weight).float()
        weights, ids = self.route(logits)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(linear(x, self.shared_expert_gate.weight).float())
            out = out + (gate * self.shared_expert(x, low).float()).to(out.dtype)
        return out


class _Weight(nn.Module):
    """A bare [rows, cols] weight under its checkpoint name (`<module>.weight`): the router,
    the shared expert's gate."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = set_weight_loader(
            nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False),
            _load_whole)


def _load_whole(param: nn.Parameter, loaded: LazyTensor, shard: object = None) -> None:
    check_shape(loaded, tuple(param.shape))
    param.data.copy_(loaded.full())
