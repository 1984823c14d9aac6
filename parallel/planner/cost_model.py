"""Roofline cost model of one forward step of a model laid out tp x pp.

A stage's time for a micro-batch is max(FLOPs / peak, bytes / bandwidth) plus its TP
collectives and a fixed per-layer overhead: prefill is compute-bound, decode reads every
weight of the stage and the KV of every sequence. Collectives are rings: AllReduce
2(n-1)·α + 2(n-1)/n·S/B, all-gather half that, p2p α + S/B; a TP group inside an NVLink
domain uses the intra-node link, otherwise the inter-node one. With pp stages and m
micro-batches in flight a step ("round": every micro-batch advances once) takes
max(m · slowest stage, one micro-batch's trip through all stages); the rest is bubble.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.validation import require

LINKS = ("intra", "inter")
LOGITS_BYTES = 4  # logits are gathered in fp32


def link_figures(cluster: ClusterConfig, link: str) -> tuple[float, float]:
    """(bytes/s, seconds of latency) of an intra-node or inter-node link."""
    if link == "intra":
        return cluster.intra_node_bandwidth_gbs * 1e9, cluster.intra_node_latency_us * 1e-6
    return cluster.inter_node_bandwidth_gbs * 1e9, cluster.inter_node_latency_us * 1e-6


def ring_allreduce_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds of a ring AllReduce of `nbytes` over `n` ranks (bytes/s, seconds per step)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth


def ring_allgather_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-gather whose gathered result is `nbytes`."""
    if n <= 1:
        return 0.0
    return (n - 1) * latency + (n - 1) / n * nbytes / bandwidth


def p2p_s(nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds to send `nbytes` from one rank to another."""
    return latency + nbytes / bandwidth


@dataclass(frozen=True, kw_only=True)
class StepWork:
    """What one forward step computes and reads (a whole batch, or one micro-batch)."""

    num_new_tokens: float = 0.0
    """Tokens run through the layers (prefill tokens plus one per decoding sequence)."""
    num_seqs: float = 0.0
    """Sequences in the step; each yields one row of logits."""
    num_kv_read: float = 0.0
    """Tokens whose K/V is read from the cache (decode contexts, prefix-cache hits)."""
    num_attended: float = 0.0
    """(query, key) pairs attention computes."""

    def __post_init__(self) -> None:
        if (self.num_new_tokens >= 0 and self.num_seqs >= 0 and self.num_kv_read >= 0
                and self.num_attended >= 0):  # False for a NaN, which the walk then names
            return  # the common case, without walking the fields (simulations build many)
        for f in fields(self):
            require(getattr(self, f.name) >= 0, f"work.{f.name}", getattr(self, f.name),
                    "a count >= 0")

    @classmethod
    def decode(cls, batch: float, context: float) -> StepWork:
        """`batch` sequences decode one token each with `context` tokens already cached."""
        return cls(num_new_tokens=batch, num_seqs=batch, num_kv_read=batch * context,
                   num_attended=batch * (context + 1))

    @classmethod
    def prefill(cls, num_tokens: float, num_cached: float = 0.0, num_seqs: float = 1) -> StepWork:
        """`num_seqs` prompts of `num_tokens` new tokens after `num_cached` cached ones, each."""
        attended = num_tokens * num_cached + num_tokens * (num_tokens + 1) / 2
        return cls(num_new_tokens=num_seqs * num_tokens, num_seqs=num_seqs,
                   num_kv_read=num_seqs * num_cached, num_attended=num_seqs * attended)

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(num_new_tokens=self.num_new_tokens + other.num_new_tokens,
                        num_seqs=self.num_seqs + other.num_seqs,
                        num_kv_read=self.num_kv_read + other.num_kv_read,
                        num_attended=self.num_attended + other.num_attended)

    def scaled(self, factor: float) -> StepWork:
        """This work times `factor` (a micro-batch's share)."""
        return StepWork(num_new_tokens=self.num_new_tokens * factor,
                        num_seqs=self.num_seqs * factor, num_kv_read=self.num_kv_read * factor,
                        num_attended=self.num_attended * factor)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one replica is laid out: what the cost model needs from a plan."""

    tp: int = 1
    """Tensor-parallel degree."""
    stage_layers: tuple[int, ...] = (1,)
    """Decoder layers per pipeline stage (pp = its length)."""
    num_micro_batches: int = 1
    """Micro-batches in flight during decode (1 when pp == 1)."""
    tp_link: str = "intra"
    """Link the TP ring runs over: intra (inside an NVLink domain) or inter."""
    stage_links: tuple[str, ...] = ()
    """Link from stage s to stage s+1 (pp - 1 entries)."""
    active_devices_per_node: int = 1
    """Devices busy on the busiest node (they may share memory bandwidth)."""
    head_first_fraction: float = 0.0
    """Share of the LM head's vocabulary on stage 0 (a split head, pp > 1); the last stage
    holds the rest and sends its normed rows and logits to stage 0."""

    def __post_init__(self) -> None:
        require(0.0 <= self.head_first_fraction < 1.0 and
                (self.head_first_fraction == 0.0 or len(self.stage_layers) > 1),
                "layout.head_first_fraction", self.head_first_fraction,
                "a fraction in [0, 1), 0 without a pipeline")
        require(self.tp >= 1, "layout.tp", self.tp, "an int >= 1")
        require(len(self.stage_layers) >= 1 and min(self.stage_layers) >= 1,
                "layout.stage_layers", self.stage_layers, "one or more stages of >= 1 layer")
        require(self.num_micro_batches >= 1, "layout.num_micro_batches", self.num_micro_batches,
                "an int >= 1")
        require(self.tp_link in LINKS, "layout.tp_link", self.tp_link, f"one of {LINKS}")
        require(len(self.stage_links) == self.pp - 1 and set(self.stage_links) <= set(LINKS),
                "layout.stage_links", self.stage_links, f"{self.pp - 1} entries from {LINKS}")
        require(self.active_devices_per_node >= 1, "layout.active_devices_per_node",
                self.active_devices_per_node, "an int >= 1")

    @property
    def pp(self) -> int:
        """Pipeline stages."""
        return len(self.stage_layers)


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """Time of a stage (or of one part of it) for one micro-batch, by cause."""

    compute_s: float = 0.0
    """Time of the compute-bound parts (FLOPs / peak)."""
    memory_s: float = 0.0
    """Time of the memory-bound parts (bytes / bandwidth)."""
    comm_s: float = 0.0
    """TP collectives."""
    overhead_s: float = 0.0
    """Fixed per-layer overhead."""

    @classmethod
    def roofline(cls, flops_s: float, bytes_s: float, comm_s: float = 0.0,
                 overhead_s: float = 0.0) -> StageTime:
        """A part bound by the slower of its compute and its memory traffic."""
        bound = (flops_s, 0.0) if flops_s >= bytes_s else (0.0, bytes_s)
        return cls(compute_s=bound[0], memory_s=bound[1], comm_s=comm_s, overhead_s=overhead_s)

    def __add__(self, other: StageTime) -> StageTime:
        return StageTime(compute_s=self.compute_s + other.compute_s,
                         memory_s=self.memory_s + other.memory_s,
                         comm_s=self.comm_s + other.comm_s,
                         overhead_s=self.overhead_s + other.overhead_s)

    def times(self, n: float) -> StageTime:
        """`n` of this part in a row."""
        return StageTime(compute_s=self.compute_s * n, memory_s=self.memory_s * n,
                         comm_s=self.comm_s * n, overhead_s=self.overhead_s * n)

    @property
    def total_s(self) -> float:
        """Wall time: the parts run one after another."""
        return self.compute_s + self.memory_s + self.comm_s + self.overhead_s


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """A step's predicted time and its split, averaged over stages (the parts sum to total)."""

    total_s: float
    """Wall time of the step (one round of the pipeline)."""
    compute_s: float
    """Compute-bound time (roofline at peak FLOP/s)."""
    memory_s: float
    """Memory-bound time (weights, KV reads and writes)."""
    comm_s: float
    """TP collectives."""
    overhead_s: float
    """Fixed per-layer overhead."""
    bubble_s: float
    """Idle stages: pipeline fill and drain, stage imbalance, hand-offs between stages."""
    p2p_s: float
    """Stage-to-stage sends on one micro-batch's path (inside the bubble)."""


@dataclass(frozen=True)
class CostModel:
    """Predicts step times and memory for a model on a cluster with a given layout."""

    shape: ModelShape
    cluster: ClusterConfig
    layout: Layout

    def __post_init__(self) -> None:
        assert sum(self.layout.stage_layers) == self.shape.num_layers, self.layout.stage_layers

    def _link(self, link: str) -> tuple[float, float]:
        return link_figures(self.cluster, link)

    def stage_weight_bytes(self, stage: int) -> int:
        """Weight bytes one device of `stage` holds."""
        s, tp, pp = self.shape, self.layout.tp, self.layout.pp
        params = self.layout.stage_layers[stage] * s.layer_params(tp)
        f = self.layout.head_first_fraction
        if stage == 0:
            params += s.embed_params(tp)
            if not s.tie_word_embeddings:  # a tied part is a view of the embedding
                params += round(f * s.head_params(tp))
        if stage == pp - 1:  # a tied head shares stage 0's matrix only when stage 0 is this one
            tied_here = s.tie_word_embeddings and pp == 1
            params += s.hidden_size if tied_here else round((1 - f) * s.head_params(tp))
        return params * s.weight_dtype_bytes

    def stage_kv_bytes_per_token(self, stage: int) -> int:
        """KV bytes one token takes on one device of `stage`."""
        return self.layout.stage_layers[stage] * self.shape.kv_bytes_per_token(self.layout.tp)

    def _rates(self) -> tuple[float, float]:
        c = self.cluster
        return c.peak_flops(self.shape.dtype), c.memory_bandwidth(self.layout.active_devices_per_node)

    def _allreduce_s(self, nbytes: float) -> float:
        return ring_allreduce_s(self.layout.tp, nbytes, *self._link(self.layout.tp_link))

    def layer_time(self, work: StepWork) -> StageTime:
        """One decoder layer: projections, attention, MLP, KV reads and writes, 2 AllReduces."""
        s, tp = self.shape, self.layout.tp
        flops_rate, bytes_rate = self._rates()
        matmul_rate = self.cluster.matmul_flops(s.dtype, work.num_new_tokens)
        compute_s = (work.num_new_tokens * s.layer_matmul_flops(tp) / matmul_rate
                     + s.attention_flops(work.num_attended, tp)
                     / (flops_rate * self.cluster.attention_efficiency))
        c = self.cluster
        kv_bytes = (work.num_kv_read + work.num_new_tokens) * s.kv_bytes_per_token(tp)
        memory_s = (s.layer_params(tp) * s.weight_dtype_bytes / bytes_rate
                    + kv_bytes / (bytes_rate * c.kv_read_fraction))
        act = work.num_new_tokens * s.hidden_size * s.dtype_bytes
        return StageTime.roofline(compute_s, memory_s,
                                  comm_s=2 * self._allreduce_s(act),
                                  overhead_s=(c.layer_overhead_us
                                              + work.num_seqs * c.seq_overhead_us) * 1e-6
                                  + work.num_kv_read * c.kv_row_overhead_ns * 1e-9)

    def embed_time(self, work: StepWork) -> StageTime:
        """Stage 0's embedding (gather one row per token, AllReduce the vocabulary shards)
        and the runtime's work per forward and per sequence outside the layers (input
        preparation, sampling)."""
        act = work.num_new_tokens * self.shape.hidden_size * self.shape.dtype_bytes
        return StageTime.roofline(0.0, act / self._rates()[1], comm_s=self._allreduce_s(act),
                                  overhead_s=(self.cluster.step_overhead_us + work.num_seqs
                                              * self.cluster.step_seq_overhead_us) * 1e-6)

    def head_time(self, work: StepWork) -> StageTime:
        """The last stage's LM head: one logits row per sequence, gathered over the TP ranks."""
        s, tp = self.shape, self.layout.tp
        bytes_rate = self._rates()[1]
        gathered = work.num_seqs * s.vocab_size * LOGITS_BYTES
        return StageTime.roofline(
            s.head_flops(work.num_seqs, tp) / self.cluster.matmul_flops(s.dtype, work.num_seqs),
            s.head_params(tp) * s.weight_dtype_bytes / bytes_rate,
            comm_s=ring_allgather_s(tp, gathered, *self._link(self.layout.tp_link)))

    def stage_time(self, stage: int, work: StepWork) -> StageTime:
        """One stage's time for `work` (one micro-batch)."""
        t = self.layer_time(work).times(self.layout.stage_layers[stage])
        f = self.layout.head_first_fraction
        if stage == 0:
            t = t + self.embed_time(work)
            if f:
                t = t + self.head_time(work).times(f)
        if stage == self.layout.pp - 1:
            t = t + self.head_time(work).times(1 - f)
        return t

    def _logits_send_s(self, work: StepWork) -> float:
        """A split head's message from the last stage to stage 0: the normed rows and the
        last stage's logits, one row per sequence."""
        f, s = self.layout.head_first_fraction, self.shape
        if not f:
            return 0.0
        nbytes = work.num_seqs * (s.hidden_size + (1 - f) * s.vocab_size) * s.dtype_bytes
        link = "intra" if "inter" not in self.layout.stage_links else "inter"
        return p2p_s(nbytes, *self._link(link))

    def step(self, work: StepWork, num_micro_batches: int | None = None, *,
             isolated: bool = False) -> StepCost:
        """One round: `work` split into micro-batches that each pass every stage once.

        In steady state the round takes its busiest stage's share (other rounds fill and
        drain the pipeline around it), at least one micro-batch's trip through every stage.
        `isolated`: the pipeline is empty before and after (a burst, such as a batch's
        prompts arriving together): the first micro-batch's trip, then one busiest-stage
        time per further micro-batch."""
        lay = self.layout
        m = lay.num_micro_batches if num_micro_batches is None else num_micro_batches
        m = max(1, min(m, int(work.num_seqs) or 1)) if lay.pp > 1 else 1
        part = work.scaled(1 / m)
        times = [self.stage_time(i, part) for i in range(lay.pp)]
        sends = [p2p_s(part.num_new_tokens * self.shape.hidden_size * self.shape.dtype_bytes,
                       *self._link(link)) for link in lay.stage_links]
        sends.append(self._logits_send_s(part))
        chain = sum(t.total_s for t in times) + sum(sends)
        slowest = max(t.total_s for t in times)
        total = chain + (m - 1) * slowest if isolated else max(m * slowest, chain)

        def mean(parts: list[float]) -> float:
            return m * sum(parts) / lay.pp

        compute, memory = mean([t.compute_s for t in times]), mean([t.memory_s for t in times])
        comm, overhead = mean([t.comm_s for t in times]), mean([t.overhead_s for t in times])
        busy = compute + memory + comm + overhead
        return StepCost(total_s=total, compute_s=compute, memory_s=memory, comm_s=comm,
                        overhead_s=overhead, bubble_s=total - busy, p2p_s=sum(sends))

    def ttft_s(self, prompt_len: int, num_cached: int = 0) -> float:
        """Time to first token of one prompt alone (its prefill through every stage)."""
        return self.step(StepWork.prefill(prompt_len - num_cached, num_cached), 1).total_s

    def tpot_s(self, batch: float, context: float) -> float:
        """Time per output token of `batch` sequences holding `context` tokens each."""
        return self.step(StepWork.decode(batch, context)).total_s

    def prefill_busy_s(self, prompt_len: int, num_cached: int = 0) -> float:
        """Time a prefill occupies the slowest stage (what it costs a busy pipeline)."""
        work = StepWork.prefill(prompt_len - num_cached, num_cached)
        return max(self.stage_time(i, work).total_s for i in range(self.layout.pp))

    def activation_bytes(self, max_tokens: int, max_seqs: int) -> int:
        """Workspace of the largest step: hidden states and MLP activations, fp32 logits."""
        s, tp = self.shape, self.layout.tp
        hidden = max_tokens * (4 * s.hidden_size + 2 * s.intermediate_size // tp) * s.dtype_bytes
        return hidden + max_seqs * s.embed_params(tp) // s.hidden_size * LOGITS_BYTES

    def kv_capacity_tokens(self, usable_bytes: float, activation_bytes: int) -> int:
        """Tokens of KV cache one replica holds: its tightest stage decides (0 if none fit)."""
        free = [usable_bytes - self.stage_weight_bytes(i) - activation_bytes
                for i in range(self.layout.pp)]
        return max(0, min(int(f // self.stage_kv_bytes_per_token(i)) for i, f in enumerate(free)))


def decode_bound_tokens_per_s(shape: ModelShape, cluster: ClusterConfig) -> float:
    """The familiar batch-1 decode bound: memory bandwidth / bytes of all the weights.

    The step model is slightly faster: a decode step gathers only the used rows of an
    untied input embedding instead of reading the whole table.
    """
    return cluster.memory_bandwidth() / shape.weight_bytes
