"""Which GPUs each self-spawned replica takes on this node.

A rank finds its GPU by its local rank among the GPUs its process sees, and every
self-spawned replica numbers its ranks from 0. Without a slice of its own, replica 1
would land on replica 0's GPUs. So replica i takes the next `sizes[i]` GPUs (its tp x pp
ranks) of those the front sees, in order, and its process sees only those
(CUDA_VISIBLE_DEVICES): replica 0, which runs in the front's process, takes the first
ones, where its local ranks already point.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

VISIBLE = "CUDA_VISIBLE_DEVICES"


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs)."""
    named = os.environ.get(VISIBLE)
    if named is not None:
        return [d.strip() for d in named.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def replica_gpus(sizes: Sequence[int], visible: Sequence[str]) -> list[list[str]]:
    """Each replica's GPUs: replica i the next `sizes[i]` of `visible`. ValueError, naming
    the replicas' sizes and the GPUs seen, when there are too few for one GPU a rank."""
    need = sum(sizes)
    if need > len(visible):
        shown = ",".join(visible) if visible else "none"
        raise ValueError(
            f"parallel.dp: {len(sizes)} replicas of {'+'.join(map(str, sizes))} ranks need "
            f"{need} GPUs, one a rank; this process sees {len(visible)} ({shown}). Allowed: "
            f"replicas whose ranks add up to at most {len(visible)}, or replicas on more "
            "nodes under torchrun, srun or mpirun")
    out, at = [], 0
    for n in sizes:
        out.append(list(visible[at:at + n]))
        at += n
    return out


def replica_env(gpus: Sequence[str]) -> dict[str, str]:
    """The environment of a replica's process that may use only `gpus`."""
    return dict(os.environ, **{VISIBLE: ",".join(gpus)})
