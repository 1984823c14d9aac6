"""Disaggregated serving's configuration (the `disagg` group of conf/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.validation import require

MODES = ("none", "manual", "auto")
CONNECTORS = ("auto", "nixl", "torch")
TORCH_WIRES = ("auto", "gloo", "gloo_pairs", "nccl")
ON_FAILURE = ("fail", "recompute")


@dataclass(frozen=True, kw_only=True)
class PhaseLayout:
    """The replicas of one phase (prefill or decode) and each one's layout."""

    replicas: int = 1
    tp: int = 1
    pp: int = 1


@dataclass(frozen=True, kw_only=True)
class DisaggConfig:
    """Whether prefill and decode run on separate replicas, and how KV moves between them."""

    mode: str = "none"
    """none: every replica prefills and decodes (colocated); manual: `prefill.replicas`
    replicas run prompts and produce each request's first token, `decode.replicas`
    replicas receive the prompt's KV and run the request to its end; auto: the planner
    weighs colocated layouts against prefill/decode splits for the cluster and scenario,
    and the run starts the better one (the phases below are then its choice)."""
    prefill: PhaseLayout = field(default_factory=PhaseLayout)
    decode: PhaseLayout = field(default_factory=PhaseLayout)
    simulate: bool = False
    """auto under a goodput scenario: decide by simulated goodput (the colocated layout and
    the closed forms' best splits each serve the scenario's requests step by step on the
    cost model; `meshserve plan ... plan.simulate=true` shows the same choice), a few
    seconds at start-up; false: by the closed forms."""
    connector: str = "auto"
    """How KV blocks move: nixl (UCX underneath), torch (shared memory between processes on
    one host, else torch.distributed: gloo), auto: nixl where it is installed."""
    torch_shm: bool = True
    """The torch connector between processes on one host: through a channel in shared
    memory per pair of ranks (false: through its wire, as between hosts)."""
    torch_wire: str = "auto"
    """The torch connector's torch.distributed wire: gloo (tagged messages over one group
    of every rank; a GPU cache staged through host memory), nccl (a group per pair of
    ranks, GPU cache to GPU cache over NVLink or InfiniBand, shared memory unused),
    gloo_pairs (nccl's pairs and ordering over gloo), auto: gloo_pairs (nccl has not yet
    run on GPUs: it is asked for by name)."""
    min_prefill_tokens: int = 256
    """Prompts shorter than this (and prompts a decode replica mostly caches already)
    skip the hop and prefill on the decode replica."""
    kv_lease_s: float = 30.0
    """How long a prefill replica holds a finished prompt's KV blocks for a decode replica
    to read them; unread after that, they are freed (counted) and a later read fails."""
    transfer_timeout_s: float = 30.0
    """Longest one KV transfer may take before it fails."""
    stream_kv: bool = True
    """The decode replica is chosen as the prompt is sent to its prefill replica, takes its
    blocks at once and reads the prompt's blocks as soon as a prefill step has computed
    them (the last step's layer by layer), so only the last layers of the last step's
    blocks are left to move after the first token. false, or a prefill replica whose
    steps do not end in order (pp > 1): every block moves once the prompt is done."""
    on_failure: str = "fail"
    """A request whose KV cannot be moved (lease expired, transfer failed): fail it with an
    error, or recompute (prefill it again on the decode replica)."""

    def __post_init__(self) -> None:
        require(self.mode in MODES, "disagg.mode", self.mode, f"one of {MODES}")
        require(self.connector in CONNECTORS, "disagg.connector", self.connector,
                f"one of {CONNECTORS}")
        require(self.torch_wire in TORCH_WIRES, "disagg.torch_wire", self.torch_wire,
                f"one of {TORCH_WIRES}")
        require(self.on_failure in ON_FAILURE, "disagg.on_failure", self.on_failure,
                f"one of {ON_FAILURE}")
        require(self.min_prefill_tokens >= 0, "disagg.min_prefill_tokens",
                self.min_prefill_tokens, "an int >= 0")
        require(self.kv_lease_s > 0, "disagg.kv_lease_s", self.kv_lease_s,
                "a positive number of seconds")
        require(self.transfer_timeout_s > 0, "disagg.transfer_timeout_s",
                self.transfer_timeout_s, "a positive number of seconds")
        for phase in ("prefill", "decode"):
            layout: PhaseLayout = getattr(self, phase)
            for degree in ("replicas", "tp", "pp"):
                value = getattr(layout, degree)
                require(isinstance(value, int) and value >= 1, f"disagg.{phase}.{degree}",
                        value, "an int >= 1")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def num_replicas(self) -> int:
        return self.prefill.replicas + self.decode.replicas

    @property
    def ranks_per_replica(self) -> list[int]:
        """Each replica's rank count, prefill replicas first."""
        return ([self.prefill.tp * self.prefill.pp] * self.prefill.replicas
                + [self.decode.tp * self.decode.pp] * self.decode.replicas)

    def phase_of(self, replica: int) -> PhaseLayout:
        """Replica `replica`'s phase layout (prefill replicas first)."""
        return self.prefill if replica < self.prefill.replicas else self.decode
