"""What the CLI composes: the runtime's groups plus what each verb itself takes."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.bench.checkpoints import DEFAULT_CACHE_DIR, SPECS
from meshserve.bench.peer_names import DEFAULT_PEERS, is_peer
from meshserve.engine.config.runtime_config import RuntimeConfig
from meshserve.launch.analysis_config import CalibrateConfig, DiagnoseConfig, PlanConfig
from meshserve.serve.serve_config import ServeConfig
from meshserve.validation import require


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """What `meshserve generate` asks the model."""

    prompts: list[str] = field(default_factory=lambda: [
        "def fibonacci(n):", "import os\n\nclass ", "    def __init__(self,"])
    """Prompts to complete."""
    max_tokens: int = 48
    """Tokens to generate per prompt."""
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 is off."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of each token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit per time it was generated."""
    repetition_penalty: float = 1.0
    """Divides positive logits of tokens in the prompt or output; 1 is off."""
    seed: int | None = None
    """Per-request seed."""
    ignore_eos: bool = False
    """Keep generating past EOS."""

    def __post_init__(self) -> None:
        require(len(self.prompts) >= 1, "generate.prompts", self.prompts, "at least one prompt")


ONLINE_APIS = ("token-ids", "text", "transformers")
"""bench.api values (bench/online.py builds each one's request)."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What `meshserve bench` runs, against which peers, and where it writes the result."""

    workload: str = "longtail"
    """A workload name (longtail, shared-prefix, latency, short, online) or a JSON workload file."""
    num_requests: int | None = None
    """Keep only the first N requests of the workload; null keeps all."""
    rate: float | None = None
    """Requests/s of Poisson arrivals (needed by 'online'); null: all arrive at t=0."""
    url: str | None = None
    """Base URL of a running `meshserve serve` (e.g. http://127.0.0.1:8000): replay the
    workload against it over HTTP (online mode) instead of running engines in-process."""
    rates: list[float] = field(default_factory=list)
    """Online mode: a sweep of Poisson rates (requests/s), one run each; empty uses bench.rate."""
    api_key: str | None = None
    """Online mode: bearer token for the server; null reads $MESHSERVE_API_KEY."""
    api: str = "token-ids"
    """Online mode, how requests are sent: token-ids (meshserve: prompt token ids,
    ignore_eos), text (the prompt decoded to text, ignore_eos: meshserve or vLLM), or
    transformers (text, exact length through generation_config: `transformers serve`)."""
    request_timeout_s: float = 600.0
    """Online mode: a request slower than this counts as failed."""
    seed: int = 0
    """Seed of the generated workloads' token ids and arrivals."""
    model: str | None = None
    """A benchmark checkpoint (tiny, big; docs/benchmarks/README.md) built on first use and cached; used as model.path."""
    cache_dir: str = DEFAULT_CACHE_DIR
    """Where the built benchmark checkpoints are kept."""
    peers: list[str] = field(default_factory=lambda: list(DEFAULT_PEERS))
    """Engines compared with meshserve: hf-static-<B> (generate, batches of B), hf-continuous."""
    repeats: int = 3
    """Timed rounds after the warm-up, each running every engine once (alternating)."""
    warmup: bool = True
    """Run every engine once, untimed, before the rounds."""
    out: str = "bench-results"
    """Directory for result.json and result.png."""
    roofline: bool = True
    """Measure memory bandwidth and matmul rate first, for MBU and MFU."""
    roofline_read_bytes: int = 2 << 30
    """Size of the fp32 tensor read to measure memory bandwidth."""
    roofline_matmul_size: int = 2048
    """N of the N x N x N fp32 matmul timed for the FLOP/s ceiling."""
    hf_max_batch_tokens: int = 512
    """max_batch_tokens of transformers' continuous batching (512 is faster than its default 8192 on these workloads)."""
    slo_ttft_s: float = 2.0
    """Time-to-first-token objective for goodput, seconds."""
    slo_tpot_s: float = 0.2
    """Time-per-output-token objective for goodput, seconds."""
    progress: bool = True
    """Show a progress bar."""
    plot: bool = True
    """Write result.png."""

    def __post_init__(self) -> None:
        require(bool(self.workload), "bench.workload", self.workload,
                "a workload name or a JSON workload file")
        require(self.num_requests is None or self.num_requests >= 1, "bench.num_requests",
                self.num_requests, "null or an int >= 1")
        require(self.rate is None or self.rate > 0, "bench.rate", self.rate,
                "null or requests/s > 0")
        require(self.workload != "online" or self.rate is not None or bool(self.rates),
                "bench.rate", self.rate, "a rate in requests/s when bench.workload=online")
        require(all(r > 0 for r in self.rates), "bench.rates", self.rates,
                "a list of requests/s > 0")
        require(not self.rates or self.url is not None, "bench.rates", self.rates,
                "empty unless bench.url names a server (the sweep is online mode)")
        require(self.api in ONLINE_APIS, "bench.api", self.api, f"one of {list(ONLINE_APIS)}")
        require(self.request_timeout_s > 0, "bench.request_timeout_s", self.request_timeout_s,
                "seconds > 0")
        require(self.model is None or self.model in SPECS, "bench.model", self.model,
                f"null or one of {sorted(SPECS)} (use model.path for a directory)")
        bad = [p for p in self.peers if not is_peer(p)]
        require(not bad and len(set(self.peers)) == len(self.peers), "bench.peers", self.peers,
                "distinct names among hf-static-<B> (B >= 1), hf-continuous and "
                "meshserve-single")
        require(self.repeats >= 1, "bench.repeats", self.repeats, "an int >= 1")
        require(bool(self.out), "bench.out", self.out, "a directory path")
        require(self.roofline_read_bytes >= 1 << 20, "bench.roofline_read_bytes",
                self.roofline_read_bytes, "at least 1 MiB")
        require(self.roofline_matmul_size >= 16, "bench.roofline_matmul_size",
                self.roofline_matmul_size, "an int >= 16")
        require(self.hf_max_batch_tokens >= 1, "bench.hf_max_batch_tokens",
                self.hf_max_batch_tokens, "an int >= 1")
        require(self.slo_ttft_s > 0 and self.slo_tpot_s > 0, "bench.slo_ttft_s/slo_tpot_s",
                (self.slo_ttft_s, self.slo_tpot_s), "seconds > 0")


@dataclass(frozen=True, kw_only=True)
class CliConfig(RuntimeConfig):
    """The runtime's groups (`.runtime` is what the runtime gets) and each verb's options."""

    generate: GenerateConfig = field(default_factory=GenerateConfig)
    """Options of `meshserve generate`."""
    bench: BenchConfig = field(default_factory=BenchConfig)
    """Options of `meshserve bench`."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """Options of `meshserve plan`."""
    diagnose: DiagnoseConfig = field(default_factory=DiagnoseConfig)
    """Options of `meshserve diagnose`."""
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    """Options of `meshserve calibrate`."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """Options of `meshserve serve`."""

    @property
    def runtime(self) -> RuntimeConfig:
        """The runtime's part, without the verbs' options."""
        return RuntimeConfig.of(self)
