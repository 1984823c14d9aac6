"""The steady-decode benchmark runs a layout and reports a per-token time."""

from __future__ import annotations

import pytest

from meshserve.bench import steady_decode


def test_steady_decode_reports_its_figures(make_checkpoint, capsys) -> None:
    path = make_checkpoint("llama")
    steady_decode.main(["--model", str(path), "--seqs", "3", "--prompt-tokens", "20",
                        "--seconds", "0.3", "parallel=single"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("3 sequences, parallel=single threads=1: ")
    ms = float(line.split(": ")[1].split(" ms")[0])
    tok_s = float(line.split(", ")[-1].split(" tok/s")[0])
    assert ms > 0 and tok_s > 0


def test_steady_decode_refuses_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        steady_decode.main(["--seqs", "0"])
