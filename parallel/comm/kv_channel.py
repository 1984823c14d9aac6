"""KV blocks between two ranks over torch.distributed (gloo on CPU, NCCL on GPUs), one
layer at a time so the receiver can place each layer as it lands.

A transfer is a header (the request's transfer id, the layer count and each layer's
shape, as int64) and then one tensor per layer; the receiver allocates from the header,
so only the dtype is agreed beforehand (at the handshake). Every wait is bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from meshserve.parallel.comm.p2p import recv, wait

_HEADER = 7
"""int64 words: transfer id, number of layers, then the 5 dims of each layer's tensor."""


class KVChannel:
    """One direction of KV traffic between this rank and global rank `peer`."""

    def __init__(self, peer: int, group: dist.ProcessGroup | None, dtype: torch.dtype,
                 device: torch.device, timeout: timedelta | None = None) -> None:
        self.peer, self.group, self.dtype, self.device = peer, group, dtype, device
        self.timeout = timeout
        self.bytes_sent = 0
        self.bytes_received = 0

    def send(self, transfer_id: int, layers: Sequence[torch.Tensor]) -> None:
        """Send one transfer: `layers`, each [2, n, block_size, heads, head_dim]."""
        if not layers:
            raise ValueError("a KV transfer needs at least one layer")
        shape = tuple(layers[0].shape)
        if len(shape) != 5 or any(tuple(t.shape) != shape for t in layers):
            raise ValueError(f"KV layers of one transfer must share one 5-d shape; got "
                             f"{[tuple(t.shape) for t in layers]}")
        header = torch.tensor([transfer_id, len(layers), *shape], dtype=torch.int64)
        self._send(header.to(self.device))
        for t in layers:
            self._send(t.to(device=self.device, dtype=self.dtype).contiguous())
            self.bytes_sent += t.numel() * t.element_size()

    def receive(self, place: Callable[[int, torch.Tensor], None] | None = None
                ) -> tuple[int, list[torch.Tensor]]:
        """Receive one transfer: (transfer id, its layers). `place(layer, tensor)` is called
        as each layer arrives (to write it into the cache before the next lands)."""
        header = recv(torch.empty(_HEADER, dtype=torch.int64, device=self.device),
                      self.peer, self.group, self.timeout).cpu().tolist()
        transfer_id, num_layers, shape = header[0], header[1], tuple(header[2:])
        layers = []
        for layer in range(num_layers):
            t = recv(torch.empty(shape, dtype=self.dtype, device=self.device), self.peer,
                     self.group, self.timeout)
            self.bytes_received += t.numel() * t.element_size()
            if place is not None:
                place(layer, t)
            layers.append(t)
        return transfer_id, layers

    def _send(self, t: torch.Tensor) -> None:
        wait(dist.isend(t, dst=self.peer, group=self.group), self.timeout)
