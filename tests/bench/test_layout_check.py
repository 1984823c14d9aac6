"""The layout check: predicted vs measured step times per tp x pp (a smoke run here; the
real measurement needs an idle machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshserve.bench.layout_check import (
    Workload,
    layout_cluster,
    load_cluster,
    main,
    parse_layouts,
    ranks,
)


def test_layouts_ranks_and_the_cluster_of_a_layout() -> None:
    assert parse_layouts("1x1,2x1,1x2,2x2") == [(1, 1), (2, 1), (1, 2), (2, 2)]
    with pytest.raises(ValueError, match=r"--layouts '2,1': allowed is a comma list of TPxPP"):
        parse_layouts("2,1")
    assert ranks([3.0, 1.0, 2.0]) == [3, 1, 2]
    cpu = load_cluster("local-cpu")
    assert layout_cluster(cpu, 2) is cpu
    four = layout_cluster(cpu, 4)
    assert (four.num_nodes, four.devices_per_node, four.nvlink_domain_size) == (1, 4, 4)
    assert four.memory_bandwidth_gbs == cpu.memory_bandwidth_gbs


def test_a_calibrated_preset_file_is_read(tmp_path: Path) -> None:
    preset = tmp_path / "cal.yaml"
    preset.write_text("# measured\ndefaults:\n  - cluster_schema\nname: cal\nsource: calibrated\n"
                      "peak_tflops_fp32: 0.1\nlayer_overhead_us: 55.0\n")
    c = load_cluster(str(preset))
    assert (c.name, c.source, c.peak_tflops_fp32, c.layer_overhead_us) == (
        "cal", "calibrated", 0.1, 55.0)
    with pytest.raises(ValueError, match=r"--cluster 'nope': neither a preset"):
        load_cluster("nope")


@pytest.mark.slow
def test_smoke_two_layouts(make_checkpoint, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    model = make_checkpoint("llama", num_hidden_layers=2)
    w = Workload(batch=2, prompt_len=4, max_tokens=2)
    assert main(["--out", str(tmp_path), "--model", str(model), "--layouts", "1x1,1x2",
                 "--batch", str(w.batch), "--prompt-len", str(w.prompt_len),
                 "--max-tokens", str(w.max_tokens)]) == 0
    doc = json.loads((tmp_path / "layout_check.json").read_text())
    assert [(r["tp"], r["pp"]) for r in doc["layouts"]] == [(1, 1), (1, 2)]
    assert doc["layouts"][1]["stage_layers"] == [[0, 1], [1, 2]]
    for row in doc["layouts"]:
        for phase in ("prefill", "decode"):
            p = row[phase]
            assert p["num_steps"] >= 1 and p["measured_s"] > 0 and p["predicted_s"] > 0
            assert {p["measured_rank"], p["predicted_rank"]} <= {1, 2}
    out = capsys.readouterr().out
    assert "tp1 pp2  decode" in out and "predicted order" in out
