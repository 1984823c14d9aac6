"""Engine configuration: KV cache, batching and scheduling knobs."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.validation import require as _require

SCHEDULING_POLICIES = ("continuous", "static")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
GRAMMAR_BACKENDS = ("auto", "xgrammar", "llguidance")
AUTO_STEP_TOKENS = 2048
"""The cap of an automatic step budget (engine.max_num_batched_tokens=auto)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine batches requests and sizes its paged KV cache."""

    block_size: int = 16
    """Tokens per KV-cache block."""

    kv_cache_dtype: str = "auto"
    """What the KV cache stores: auto (the model's compute dtype), float32, bfloat16, float16.
    Attention reads it into the compute dtype. A float32 model on the CPU with a bfloat16
    cache reads half the bytes per decode step and holds twice the tokens, at bf16's
    rounding of K and V (the C kernels read fp32 and bf16 caches; GPUs take the model's
    dtype only)."""

    num_gpu_blocks: int | None = None
    """KV blocks per rank; None sizes the cache from `kv_cache_memory` / `gpu_memory_utilization`."""

    kv_cache_memory: int = 1 << 30
    """Bytes of KV cache per rank on CPU (ignored on GPU and when `num_gpu_blocks` is set)."""

    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the runtime may use (weights, activations, KV cache)."""

    max_num_seqs: int = 256
    """Most sequences in one step's batch."""

    max_num_batched_tokens: int | str = 2048
    """Token budget of one step (prefill chunks plus decodes); 'auto': each step's budget
    keeps a step carrying decodes within scenario.tpot_slo_ms, by a model of step time
    seeded from the cost model and fitted to the run's own steps, up to AUTO_STEP_TOKENS
    (the whole cap when no decode waits; engine/core/step_budget.py)."""

    max_model_len: int | None = None
    """Longest prompt + output; None takes the model's max_position_embeddings."""

    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining token budget over several steps."""

    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prefixes (block-hash chains)."""

    policy: str = "continuous"
    """Scheduling policy: 'continuous' (iteration-level) or 'static' (batches run to completion)."""

    static_batch_size: int = 16
    """Batch size of the 'static' policy."""

    seed: int = 0
    """Seed for requests that sample without a seed of their own."""

    cuda_graphs: bool = True
    """Run decode-only steps as CUDA graphs captured at bucketed batch sizes (CUDA only)."""

    async_scheduling: bool | None = None
    """Schedule and launch step n+1 while step n runs on the device, feeding the tokens it
    samples from the device (the host reads them one step later). Any layout without a
    pipeline: one rank, or a TP group (the driver broadcasts its tokens to the other TP
    ranks on the device); true with parallel.pp > 1 is refused. null: on for one-rank CUDA
    runs, off elsewhere (on a CPU there is nothing to overlap)."""

    cpu_huge_pages: bool = True
    """Put a CPU run's weights and KV cache on transparent huge pages (madvise; where the
    kernel allows none, on small pages as before): decode streams both from memory every
    step, and 2 MiB pages spare it a TLB miss every 4 KiB."""

    step_log: str | None = None
    """JSON-lines file the engine appends one step record to per step (parallel/planner/diagnosis.py's
    StepRecord, read by `meshserve diagnose diagnose.records=...`); null writes none."""

    structured_outputs_backend: str = "auto"
    """The grammar library behind structured outputs: xgrammar (its token masks cost least
    per step; needs transformers), llguidance (no dependencies), or auto: xgrammar where
    it imports, else llguidance."""

    @property
    def auto_step_budget(self) -> bool:
        """Whether each step's token budget follows the TPOT target (max_num_batched_tokens
        'auto')."""
        return self.max_num_batched_tokens == "auto"

    @property
    def step_token_cap(self) -> int:
        """The most tokens one step carries: max_num_batched_tokens, AUTO_STEP_TOKENS for
        'auto' (what activations are sized for)."""
        n = self.max_num_batched_tokens
        return AUTO_STEP_TOKENS if isinstance(n, str) else n

    def __post_init__(self) -> None:
        _require(self.structured_outputs_backend in GRAMMAR_BACKENDS,
                 "engine.structured_outputs_backend", self.structured_outputs_backend,
                 f"one of {GRAMMAR_BACKENDS}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "engine.kv_cache_dtype",
                 self.kv_cache_dtype, f"one of {KV_CACHE_DTYPES}")
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 "engine.block_size", self.block_size, "a power of two >= 1")
        _require(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
                 "engine.num_gpu_blocks", self.num_gpu_blocks, "null or an int >= 1")
        _require(self.kv_cache_memory >= 1, "engine.kv_cache_memory", self.kv_cache_memory,
                 "a byte count >= 1")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "engine.gpu_memory_utilization",
                 self.gpu_memory_utilization, "a fraction in (0, 1]")
        _require(self.max_num_seqs >= 1, "engine.max_num_seqs", self.max_num_seqs, "an int >= 1")
        _require(self.max_num_batched_tokens == "auto" or (
                     isinstance(self.max_num_batched_tokens, int)
                     and self.max_num_batched_tokens >= 1),
                 "engine.max_num_batched_tokens", self.max_num_batched_tokens,
                 "an int >= 1 or 'auto'")
        _require(self.max_model_len is None or self.max_model_len >= 1, "engine.max_model_len",
                 self.max_model_len, "null or an int >= 1")
        _require(self.policy in SCHEDULING_POLICIES, "engine.policy", self.policy,
                 f"one of {SCHEDULING_POLICIES}")
        _require(self.step_log is None or bool(self.step_log), "engine.step_log",
                 self.step_log, "null or a file path")
        _require(self.static_batch_size >= 1, "engine.static_batch_size", self.static_batch_size,
                 "an int >= 1")

