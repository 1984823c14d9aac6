"""Structured outputs: grammars compiled by xgrammar or llguidance, one matcher per
constrained sequence, and their token bitmasks applied to the batched logits.

Both libraries take the same four kinds of constraint (a JSON schema, any JSON object, a
regular expression, an EBNF grammar in GBNF form; a choice of strings becomes a grammar),
compile them against the model's tokenizer, and answer, for each step, a bitmask of the
tokens allowed next (bit t of word t // 32). xgrammar's masks cost the least per step
(docs/benchmarks/ has the measurement) but it needs transformers at run time; llguidance
needs nothing. `auto` takes xgrammar where it imports.

A matcher advances by the tokens actually sampled; it rolls back and checks drafts
(`validate`) for speculative decoding. One that can take nothing more (terminated, or in
an error state) allows the end-of-sequence tokens only, so its sequence ends.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from meshserve.engine.config.run import Run
from meshserve.engine.core.sampling_params import StructuredOutputs

_POWERS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)
"""Bit i of an int32 word as torch stores it (bit 31 is the sign)."""
_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)
"""The logit bias of a token whose bit is 0 (not allowed) or 1."""
_SOURCE_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's prefix to an error: '[05:47:32] /project/cpp/regex_converter.cc:94: '."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask."""
    return (vocab_size + 31) // 32


def _gbnf(spec: StructuredOutputs) -> str:
    """A choice or grammar request's grammar, in GBNF."""
    if spec.kind == "choice":
        assert spec.choice is not None
        return _choice_grammar(spec.choice)
    assert spec.grammar is not None
    return spec.grammar


def _choice_grammar(choices: Sequence[str]) -> str:
    """GBNF for exactly one of `choices` (JSON string literals are GBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Matcher(Protocol):
    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept(self, token: int) -> bool: ...
    @property
    def done(self) -> bool: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar; ValueError with the library's words if it cannot be."""
        ...

    def matcher(self, compiled: Any) -> Matcher: ...

    def fill(self, rows: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Each matcher's allowed tokens into its row of `bitmask` (host, int32)."""
        ...


class _LLGuidanceMatcher:
    def __init__(self, m: Any) -> None:
        self.m = m

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self.m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(token))

    @property
    def done(self) -> bool:
        return bool(self.m.is_stopped() or self.m.is_error())


class LLGuidanceBackend:
    """llguidance: Rust, no dependencies; grammars as Lark (GBNF converted)."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import llguidance
        from llguidance.gbnf_to_lark import gbnf_to_lark

        self._llg, self._gbnf_to_lark = llguidance, gbnf_to_lark
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_ids))
        self._executor = llguidance.LLExecutor()

    def compile(self, spec: StructuredOutputs) -> str:
        M = self._llg.LLMatcher
        kind = spec.kind
        if kind == "json":
            schema = spec.json
            assert schema is not None
            grammar = M.grammar_from_json_schema(
                schema if isinstance(schema, str) else dict(schema),
                overrides={"whitespace_flexible": False})
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema({"type": "object"},
                                                 overrides={"whitespace_flexible": False})
        elif kind == "regex":
            assert spec.regex is not None
            grammar = M.grammar_from_regex(spec.regex)
        else:
            gbnf = _gbnf(spec)
            try:
                grammar = M.grammar_from_lark(self._gbnf_to_lark(gbnf))
            except Exception as e:  # noqa: BLE001 - the converter's parse error
                raise ValueError(str(e).strip() or type(e).__name__) from None
        error = M.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error.strip())
        return grammar

    def matcher(self, compiled: str) -> Matcher:
        return _LLGuidanceMatcher(self._llg.LLMatcher(self.tokenizer, compiled, log_level=0))

    def fill(self, rows: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        # Rows on llguidance's own thread pool, the GIL released.
        pairs = [(m.m, row) for m, row in rows]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(),
                                               bitmask.shape[1] * 4, bitmask.shape[0])


class _XGrammarMatcher:
    def __init__(self, m: Any) -> None:
        self.m = m

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    @property
    def done(self) -> bool:
        return bool(self.m.is_terminated())


class XGrammarBackend:
    """xgrammar: masks precomputed per grammar, the cheapest per step; grammars as GBNF."""

    name = "xgrammar"

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                       stop_token_ids=list(eos_ids))
        self.compiler = xgrammar.GrammarCompiler(info)

    def compile(self, spec: StructuredOutputs) -> Any:
        c = self.compiler
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json
                assert schema is not None
                return c.compile_json_schema(schema if isinstance(schema, str) else dict(schema),
                                             any_whitespace=False)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                assert spec.regex is not None
                return c.compile_regex(spec.regex)
            return c.compile_grammar(_gbnf(spec))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own kinds
            text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ValueError(_SOURCE_LOCATION.sub("", text)) from None

    def matcher(self, compiled: Any) -> Matcher:
        return _XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def fill(self, rows: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        for m, row in rows:
            m.fill(bitmask, row)


def make_backend(name: str, model_dir: Path, vocab_size: int,
                 eos_ids: Sequence[int]) -> GrammarBackend:
    """The backend engine.structured_outputs_backend names, for the model's tokenizer."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"structured_outputs: {model_dir} has no tokenizer.json, which the "
                         "grammar is compiled against")
    if name in ("auto", "xgrammar"):
        try:
            return XGrammarBackend(path, vocab_size, eos_ids)
        except ImportError:
            if name == "xgrammar":
                raise ValueError("engine.structured_outputs_backend='xgrammar': xgrammar (and "
                                 "transformers) are not installed; allowed: pip install "
                                 "xgrammar, or llguidance") from None
    try:
        return LLGuidanceBackend(path.read_text(), vocab_size, eos_ids)
    except ImportError:
        raise ValueError("structured_outputs: neither xgrammar nor llguidance is installed; "
                         "allowed: pip install llguidance") from None


class GrammarCompiler:
    """A backend and the grammars it compiled, cached by constraint: one per model and
    backend in a process, so the engine's check at admission and the sampler's matchers
    compile each grammar once."""

    CACHE = 64

    def __init__(self, backend: GrammarBackend) -> None:
        self.backend = backend
        self._compiled: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self._lock = threading.Lock()  # data-parallel replicas may share it across threads

    def compile(self, spec: StructuredOutputs) -> Any:
        """The grammar for `spec` (a ValueError naming the request's field if it has none)."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        try:
            compiled = self.backend.compile(spec)
        except ValueError as e:
            raise ValueError(f"{spec.source}: {spec.kind} cannot be compiled by "
                             f"{self.backend.name} ({e})") from None
        with self._lock:
            self._compiled[spec] = compiled
            if len(self._compiled) > self.CACHE:
                self._compiled.popitem(last=False)
        return compiled


class Grammars:
    """One matcher per constrained sequence of one sampling rank, and their bitmasks."""

    def __init__(self, compiler: GrammarCompiler, vocab_size: int,
                 eos_ids: Sequence[int]) -> None:
        self.compiler, self.backend, self.vocab_size = compiler, compiler.backend, vocab_size
        self.eos_ids = sorted(set(eos_ids))
        self.matchers: dict[int, Matcher] = {}

    def track(self, seq_id: int, spec: StructuredOutputs) -> None:
        self.matchers[seq_id] = self.backend.matcher(self.compiler.compile(spec))

    def forget(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def bitmask(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """[len(seq_ids), words] int32 on the host: each sequence's allowed next tokens."""
        mask = torch.zeros(len(seq_ids), bitmask_words(self.vocab_size), dtype=torch.int32)
        matchers = [self.matchers[i] for i in seq_ids]
        live = [(m, row) for row, m in enumerate(matchers) if not m.done]
        if live:
            self.backend.fill(live, mask)
        ended = (~mask.any(dim=1)).nonzero().flatten().tolist()
        for row in ended:  # nothing more (or an error): the sequence ends
            for t in self.eos_ids:
                mask[row, t // 32] |= _bit(t % 32)
        return mask

    def accept(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> None:
        for seq_id, token in zip(seq_ids, tokens):
            m = self.matchers.get(seq_id)
            if m is not None and not m.done:
                m.accept(token)


_COMPILERS: dict[tuple[str, str, int], tuple[GrammarCompiler, list[int]]] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(run: Run) -> tuple[GrammarCompiler, list[int]]:
    """This process's compiler for the run's model and configured backend, and the EOS
    tokens the grammars end with (the config's and the tokenizer's)."""
    key = (str(run.model_dir), run.config.engine.structured_outputs_backend,
           run.arch.vocab_size)
    with _COMPILERS_LOCK:
        if key not in _COMPILERS:
            from meshserve.models.tokenizer import Tokenizer

            eos = set(run.arch.eos_token_ids)
            if (run.model_dir / "tokenizer.json").is_file():
                tok_eos = Tokenizer(run.model_dir).eos_token_id
                if tok_eos is not None:
                    eos.add(tok_eos)
            backend = make_backend(key[1], run.model_dir, key[2], sorted(eos))
            _COMPILERS[key] = (GrammarCompiler(backend), sorted(eos))
        return _COMPILERS[key]


def make_grammars(run: Run) -> Grammars:
    """A sampling rank's grammar state for the run's model (the process's compiler)."""
    compiler, eos = compiler_for(run)
    return Grammars(compiler, run.arch.vocab_size, eos)


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed int torch stores."""
    return -(1 << 31) if i == 31 else 1 << i


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Mask (to -inf, in place) the tokens each of `rows` may not take: bitmask
    [len(rows), words] int32 on the host, applied on the logits' device."""
    vocab, every_row = logits.shape[-1], len(rows) == logits.shape[0]
    idx = None if every_row else torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    target = logits if idx is None else logits.index_select(0, idx)
    if logits.device.type == "cpu":
        # numpy unpacks the little-endian words' bytes in order (bit t of word w at column
        # 32 w + t); adding a 0 / -inf bias is cheaper than torch's masked_fill on a CPU.
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        target.add_(torch.from_numpy(np.take(_BIAS, bits[:, :vocab])))
    else:
        mask = bitmask.to(logits.device, non_blocking=True)
        allowed = (mask.unsqueeze(-1) & _POWERS.to(logits.device)).ne(0).flatten(1)
        target.masked_fill_(~allowed[:, :vocab], float("-inf"))
    if idx is not None:
        logits.index_copy_(0, idx, target)
