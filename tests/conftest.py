"""Shared fixtures: small random Hugging Face checkpoints built with transformers itself;
a TCP store to connect to."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

# Two test workers share two cores: OpenMP threads that finish a parallel region sleep at
# once rather than spin for milliseconds on a core the other worker wants (set before torch
# loads libgomp, which reads it once; the ranks tests launch inherit it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist
from helpers.run_ranks import RunRanks, ranks_runner

from meshserve.parallel.comm.discovery import free_port
from meshserve.parallel.comm.shm_names import PREFIX_ENV


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker names its shared-memory files apart (the ranks it
    starts inherit the prefix), so a test that counts what is left counts its own. Ports
    come from the OS (free_port) and folders from tmp_path, both apart per worker already."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        os.environ[PREFIX_ENV] = f"meshserve-{worker}"

FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}

BASE_SHAPE: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


def build_checkpoint(path: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random `family` model with transformers' save_pretrained into `path`."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    torch.manual_seed(seed)
    config = config_cls(**{**BASE_SHAPE, **overrides})
    model = model_cls(config).eval()
    # Random init leaves biases at zero and q/k norms (Qwen3) at one; give them values so
    # their loading and use are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make_checkpoint(family, **config_overrides) -> directory (cached per argument set)."""
    cache: dict[str, Path] = {}

    def make(family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        key = json.dumps([family, seed, overrides], sort_keys=True, default=str)
        if key not in cache:
            cache[key] = build_checkpoint(tmp_path_factory.mktemp(family), family, seed,
                                          **overrides)
        return cache[key]

    return make


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers reference for a checkpoint directory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture
def run_ranks(tmp_path: Path) -> RunRanks:
    """run_ranks(program, n, timeout_s): `program` as n rank processes (argv: rank, a file
    store path); each must exit 0 printing 'ok <rank>'. Returns their stderr."""
    return ranks_runner(tmp_path)


@pytest.fixture
def one_thread():
    """torch on one thread for the test (the C kernels' single-thread paths)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_reference() -> Callable[..., torch.nn.Module]:
    """hf_reference(path, dtype) -> the transformers model (the oracle)."""
    return hf_model


TOKENIZER_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
]


def add_tokenizer(path: Path, vocab_size: int) -> Path:
    """Train a small byte-level BPE into `path` (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_TEXT * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}# assistant:{% endif %}"}))
    return path


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama checkpoint with a real (tiny) BPE tokenizer, for text in / text out."""
    path = build_checkpoint(tmp_path_factory.mktemp("text"), "llama", seed=5)
    return add_tokenizer(path, BASE_SHAPE["vocab_size"])


# Under CI=true a skip the CI machine should not need fails the run (tests/helpers/ci_skips.py).
from helpers.ci_skips import pytest_runtest_makereport  # noqa: E402, F401


@pytest.fixture
def open_store() -> Iterator[Callable[[], dist.Store]]:
    """Connections to a fresh TCP store this test hosts (for threads that each play a
    rank)."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)

    def connect() -> dist.Store:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))

    yield connect
    del server
