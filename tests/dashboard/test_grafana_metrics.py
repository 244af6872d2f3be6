"""``deploy/``: every metric the Grafana dashboard queries is one that a live router and a
worker with a host KV tier expose, and the Prometheus config scrapes both kinds."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboard.conftest import Fleet
from tests.dashboard.promql import metric_names
from tests.support.processes import REPO_ROOT
from tests.worker.worker_process import AUTH, served_model

DEPLOY = REPO_ROOT / "deploy"
# The series a metric family of each type exposes, by suffix.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count", "_created"),
    "untyped": ("",),
}


def exposed_series(url: str, headers: dict[str, str] | None = None) -> set[str]:
    """Every series name ``url`` (a /metrics) declares, sampled yet or not: a labelled
    counter such as errors has no sample until the first error, but Prometheus will
    have it then."""
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=5) as response:
        text = response.read().decode()
    return {
        family.name + suffix
        for family in text_string_to_metric_families(text)
        for suffix in _SUFFIXES[family.type]
    }


def panel_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads((DEPLOY / "grafana" / "kvserve.json").read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        (
            'histogram_quantile(0.99, sum by (le) (rate(a_bucket{job="x"}[$__rate_interval])))',
            {"a_bucket"},
        ),
        ("sum by (instance) (rate(b_total[5m])) / on(instance) c", {"b_total", "c"}),
        ("d_used / d_total > bool 0.5", {"d_used", "d_total"}),
    ],
)
def test_metric_names_of_an_expression(expression: str, names: set[str]) -> None:
    assert metric_names(expression) == names


def test_every_metric_the_grafana_dashboard_queries_exists(fleet: Fleet) -> None:
    body = {"model": served_model(fleet.workers[0]), "prompt": "hello", "max_tokens": 2}
    response = httpx.post(fleet.router.url + "/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    exposed = exposed_series(fleet.router.url + "/metrics")
    for worker in fleet.workers:
        exposed |= exposed_series(worker.url + "/metrics", AUTH)

    expressions = panel_expressions()
    assert len(expressions) >= 15
    missing = {}
    for title, expression in expressions:
        names = metric_names(expression)
        assert names, f"{title}: no metric in {expression!r}"
        if names - exposed:
            missing[title] = sorted(names - exposed)
    assert not missing


def test_the_dashboard_covers_the_operators_questions() -> None:
    queried = set().union(*(metric_names(expr) for _, expr in panel_expressions()))
    assert {
        "kvserve_router_requests_total",
        "kvserve_router_errors_total",
        "kvserve_router_ttft_seconds_bucket",
        "kvserve_router_in_flight_requests",
        "kvserve_router_decisions_total",
        "kvserve_prefix_cache_hit_tokens_total",
        "kvserve_prefix_cache_queried_tokens_total",
        "kvserve_kv_blocks_used",
        "kvserve_kv_blocks_cached",
        "kvserve_kv_blocks_free",
        "kvserve_kv_tier_host_blocks",
    } <= queried
    dashboard = json.loads((DEPLOY / "grafana" / "kvserve.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and "datasource" in variables


def test_prometheus_scrapes_the_router_and_the_workers() -> None:
    config = yaml.safe_load(Path(DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvserve-router", "kvserve-workers"}
    for job in jobs.values():
        assert job.get("metrics_path", "/metrics") == "/metrics"
        targets = [t for static in job["static_configs"] for t in static["targets"]]
        assert targets and all(":" in target and "/" not in target for target in targets)
