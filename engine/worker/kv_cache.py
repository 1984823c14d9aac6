"""Sizing and allocating one rank's paged KV cache."""

from __future__ import annotations

import torch

from meshserve.engine.config.engine_config import EngineConfig
from meshserve.kernels.host_memory import huge_page_empty


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> int:
    """K and V of one block across this rank's layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def num_kv_blocks(config: EngineConfig, block_bytes: int, device: torch.device,
                  weight_bytes: int) -> int:
    """Blocks that fit the budget: explicit count, CPU bytes, or a GPU memory fraction."""
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free)
        budget -= int(0.05 * total)  # headroom for activations and the sampler
        if budget < block_bytes:
            raise ValueError(f"engine.gpu_memory_utilization={config.gpu_memory_utilization} "
                             f"leaves no room for the KV cache after {weight_bytes / 2**30:.1f} "
                             "GiB of weights: allowed is a larger fraction or a smaller model")
        return budget // block_bytes
    blocks = config.kv_cache_memory // block_bytes
    if blocks < 1:
        raise ValueError(f"engine.kv_cache_memory={config.kv_cache_memory} holds no KV block of "
                         f"{block_bytes} bytes: allowed is at least {block_bytes}")
    return blocks


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device,
                      huge_pages: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim], zeroed (on
    the CPU with `huge_pages` on huge pages: decode attention walks the blocks in table
    order, anywhere in the cache)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def zeros() -> torch.Tensor:
        if huge_pages and torch.device(device).type == "cpu":
            # Already zero: zero_() faults every page in now, not during decode steps.
            return huge_page_empty(shape, dtype).zero_()
        return torch.zeros(shape, dtype=dtype, device=device)

    return [(zeros(), zeros()) for _ in range(num_layers)]
