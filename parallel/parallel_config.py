"""How the model is laid out over ranks: tensor, pipeline and data parallel degrees."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.validation import require

ROUTERS = ("cache_aware", "least_loaded", "round_robin")
BACKENDS = ("auto", "gloo", "nccl")


CPU_ALLREDUCE = ("auto", "gloo")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel degrees; tp * pp * dp ranks in all."""

    tp: int = 1
    """Tensor-parallel degree (inside one NVLink domain)."""

    pp: int = 1
    """Pipeline-parallel degree (stages may cross nodes)."""

    dp: int = 1
    """Data-parallel replicas."""

    auto: bool = False
    """Let the planner choose tp and pp (parallel=auto) for the cluster and scenario; under
    a launcher, for the ranks it started (tp, pp and dp are then ignored)."""

    backend: str = "auto"
    """torch.distributed backend for tensors: auto (nccl on GPU, gloo on CPU), gloo, nccl."""

    num_micro_batches: int | None = None
    """Micro-batches in flight with pp > 1; null means pp."""

    micro_batch_tokens: int | None = None
    """Token budget of one micro-batch with pp > 1; null: engine.max_num_batched_tokens on
    GPUs, on CPUs that over twice the micro-batches in flight, at least 256
    (engine/core/micro_batch.py, micro_batch_cap)."""

    router: str = "cache_aware"
    """Which data-parallel replica a request goes to: cache_aware (the replica whose
    prompts so far match the longest prefix of it, unless load is out of balance),
    least_loaded, round_robin (engine/replicas/router.py)."""

    timeout_s: float = 60.0
    """A rank silent this long is declared dead and every rank exits with an error."""

    cpu_allreduce: str = "auto"
    """CPU tensor parallelism: auto sums through shared memory when a TP group's ranks share
    a host (x86-64), gloo always uses gloo."""

    split_lm_head: bool = True
    """Pipelines of TP size 1: the first stage holds half the LM head's vocabulary and the
    last stage the other half, so the head's cost (large next to a layer in small models,
    paid for every decode token) does not all fall on the last stage. The last stage sends
    its normed rows and logits to the first, which adds its logits and samples."""

    cpu_p2p: str = "auto"
    """CPU pipeline parallelism: auto passes activations between stages on one host (and
    sampled tokens back to the driver) through shared-memory rings (x86-64), gloo always
    uses gloo."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= 1, f"parallel.{name}", v, "an int >= 1")
        require(self.backend in BACKENDS, "parallel.backend", self.backend, f"one of {BACKENDS}")
        require(self.num_micro_batches is None or self.num_micro_batches >= 1,
                "parallel.num_micro_batches", self.num_micro_batches, "null or an int >= 1")
        require(self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
                "parallel.micro_batch_tokens", self.micro_batch_tokens, "null or an int >= 1")
        require(self.router in ROUTERS, "parallel.router", self.router, f"one of {ROUTERS}")
        require(self.timeout_s > 0, "parallel.timeout_s", self.timeout_s, "a number of seconds > 0")
        require(self.cpu_allreduce in CPU_ALLREDUCE, "parallel.cpu_allreduce", self.cpu_allreduce,
                f"one of {CPU_ALLREDUCE}")
        require(self.cpu_p2p in CPU_ALLREDUCE, "parallel.cpu_p2p", self.cpu_p2p,
                f"one of {CPU_ALLREDUCE}")

    @property
    def world_size(self) -> int:
        """Ranks the layout needs."""
        return self.tp * self.pp * self.dp
