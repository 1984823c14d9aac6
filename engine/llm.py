"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from meshserve.compose import presets
from meshserve.engine.bootstrap import start_client
from meshserve.engine.config.runtime_config import RuntimeConfig, load_runtime_config
from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.parallel.comm.ranks import RankFailure


def model_overrides(model: str | None) -> list[str]:
    """Hydra overrides selecting `model`: a local directory or a preset name."""
    if model is None:
        return []
    if Path(model).expanduser().is_dir():
        return [f"model.path='{Path(model).expanduser().resolve()}'",
                f"model.name='{Path(model).name}'"]
    if model in presets("model"):
        return [f"model={model}"]
    raise ValueError(f"model={model!r}: neither a directory nor a preset; allowed: a local "
                     f"Hugging Face model directory or one of {', '.join(presets('model'))}")


class LLM:
    """Generate completions for a batch of prompts with continuous batching.

    `LLM("meshcoder", max_num_seqs=64, tp=2, enable_prefix_caching=False)`: a keyword is
    any leaf field of the runtime config whose name is unique across its groups, or a
    group with a dict (`engine={"max_num_seqs": 64}`); `overrides` takes Hydra strings
    (`["parallel.tp=2"]`); `config` a RuntimeConfig as it is.

    With parallel.tp / parallel.pp > 1 the ranks are started by this object (or, under
    torchrun, srun or mpirun, found running): on every rank but 0 the constructor serves
    rank 0 until it shuts down and then exits the process, so one script runs on every
    rank. Under a launcher with parallel.dp > 1 the ranks split into replicas: rank 0 is
    the front, each other replica's driver serves the front, the rest their driver.

    `min_replicas`: with replicas, how many must stay up; a lost replica's requests then
    end with `finish_reason='error'` (generate raises RankFailure on one). None, the
    default: every replica is needed, and losing one raises RankFailure.
    """

    def __init__(self, model: str | None = None, overrides: Sequence[str] = (), *,
                 config: RuntimeConfig | None = None, progress: bool = True,
                 min_replicas: int | None = None, **kwargs: Any) -> None:
        if config is not None and (model is not None or overrides or kwargs):
            raise TypeError("LLM(config=...) takes the configuration as it is: allowed is "
                            "config alone, or model / overrides / keyword arguments")
        if config is None:
            config = load_runtime_config(model_overrides(model) + list(overrides), **kwargs)
        self.engine = start_client(config, progress=progress, min_replicas=min_replicas)
        self.config = self.engine.config  # the layout it runs: parallel=auto resolved
        self.progress = progress

    def shutdown(self) -> None:
        """Stop the ranks (if several) and free their process groups and ports."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self):  # noqa: ANN201 - the engine's Tokenizer or None
        """The model's tokenizer (None for checkpoints without tokenizer.json)."""
        return self.engine.tokenizer

    def generate(self, prompts: Sequence[str | list[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the prompts' order.

        A prompt that the engine rejects raises ValueError before any work starts.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_list(len(prompts), sampling_params)
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else self.progress)

    def _run(self, ids: list[str], show: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not show, leave=False)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error is not None:
                    bar.close()
                    raise RankFailure(out.error)
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    @staticmethod
    def _params_list(n: int, sp: SamplingParams | Sequence[SamplingParams] | None
                     ) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"sampling_params: {len(sp)} given for {n} prompts; allowed is one "
                             "SamplingParams or one per prompt")
        return sp
