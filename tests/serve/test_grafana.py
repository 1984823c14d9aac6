"""docs/grafana/meshserve.json: a Grafana dashboard whose every query names metrics and
labels that a running server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "meshserve.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",)}


def _queries(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return exprs + [v["definition"] for v in dash["templating"]["list"] if "definition" in v]


def _exported(url: str) -> dict[str, set[str]]:
    """Every series name a scrape may hold -> the label names its samples carry."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(fam.type, ("",)):
            out.setdefault(fam.name + suffix, set())
        for sample in fam.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_the_dashboard_is_grafana_json_with_a_query_per_panel() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["panels"] and dash["uid"] == "meshserve"
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    for p in dash["panels"]:
        assert p["type"] in ("timeseries", "stat") and p["title"] and p["gridPos"]
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])


def test_every_metric_and_label_the_panels_query_exists(server) -> None:  # noqa: ANN001
    # One finished request and one error response, so labelled series have samples.
    body = {"model": "meshcoder", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": -1},
                      timeout=60).status_code == 400
    exported = _exported(server.url)
    dash = json.loads(DASHBOARD.read_text())
    for expr in _queries(dash):
        names = re.findall(r"\bmeshserve_\w+", expr)
        assert names, expr
        for name in names:
            assert name in exported, f"{name} (in {expr!r}) is not exported"
        # Labels grouped by or matched on must be on every metric of the query.
        used = set()
        for group in re.findall(r"by \(([^)]*)\)", expr):
            used |= {g.strip() for g in group.split(",")} - {"le"}
        for selector in re.findall(r"\{([^}]*)\}", expr):
            used |= set(re.findall(r"(\w+)\s*=~?", selector))
        labelled = [n for n in names if not n.endswith(("_sum", "_count"))]
        for name in labelled:
            assert used <= exported[name], (f"{expr!r}: {name} has labels "
                                            f"{sorted(exported[name])}, not {sorted(used)}")
