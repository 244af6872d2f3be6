"""The dashboard in a real browser (Debian's chromium, headless, driven by Playwright)
against a live fleet: the numbers it shows are the ones ``/metrics`` says, the router's and
the workers', once the fleet is idle. The test saves a screenshot: to the path in
``KVSERVE_DASHBOARD_SCREENSHOT`` when set (``docs/img/dashboard.png`` is made this way),
else to the test's tmp folder."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from kvserve.router.dashboard.quantile import histogram_quantile
from tests.dashboard.conftest import ADMIN_KEY, HOST_CACHE_BLOCKS, Fleet
from tests.support.metrics_text import by_label, samples
from tests.worker.worker_process import AUTH, served_model

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
RENDER_TIMEOUT_MS = 20_000
PREFIXES = [  # two long shared prompts: cache_aware keeps each on the worker that has it
    "The fleet shares this long system prompt about key-value caches. " * 8,
    "An entirely different document, about routing requests by prefix. " * 8,
]
CHROMIUM_FLAGS = [
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# Every number the page shows, keyed as the test compares them.
COLLECT_SHOWN = """() => {
  const shown = {};
  for (const node of document.querySelectorAll("[data-fleet]"))
    shown[`fleet/${node.dataset.fleet}`] = node.textContent;
  for (const node of document.querySelectorAll("[data-worker]"))
    shown[`${node.dataset.worker}/${node.dataset.field}`] = node.textContent;
  for (const node of document.querySelectorAll("[data-decision]"))
    shown[`decision/${node.dataset.decision}`] = node.textContent;
  return shown;
}"""
COLLECT_RECENT = """() => [...document.querySelectorAll("tr[data-recent]")].map((row) => [
  row.querySelector("[data-field=worker]").textContent,
  row.querySelector("[data-field=reason]").textContent,
])"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (apt-get install chromium; .ci/run does)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def _send_round(fleet: Fleet, question: str) -> list[tuple[str, str]]:
    """One completion per shared prefix; (worker, reason) of each, oldest first."""
    served = []
    model = served_model(fleet.workers[0])
    with httpx.Client(base_url=fleet.router.url, headers=AUTH, timeout=60) as client:
        for prefix in PREFIXES:
            body = {"model": model, "prompt": prefix + question, "max_tokens": 4}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            reason = response.headers["x-kvserve-decision"].split("reason=")[1].split(";")[0]
            served.append((response.headers["x-kvserve-worker"], reason))
    return served


def _wait_for_renders(page: Page, count: int) -> None:
    """Let the page fetch ``count`` more times (a second each, so the router samples too)."""
    renders = int(page.evaluate("document.body.dataset.renders || '0'"))
    page.wait_for_function(
        f"Number(document.body.dataset.renders || 0) >= {renders + count}",
        timeout=RENDER_TIMEOUT_MS,
    )


def _ttft_buckets(router: Samples) -> dict[str, list[tuple[float, float]]]:
    """The router's TTFT histogram per worker: (le, cumulative count), ascending."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    for (name, labels), value in router.items():
        if name == "kvserve_router_ttft_seconds_bucket":
            label = dict(labels)
            buckets.setdefault(label["worker"], []).append((float(label["le"]), value))
    return {worker: sorted(pairs) for worker, pairs in buckets.items()}


def _fixed(value: float) -> str:
    """``value.toFixed(1)`` as the page's script writes it: the exact binary value, a tie
    rounded up (Python's format rounds a tie to even: 99.25 is 99.2 there, 99.3 here)."""
    return str(Decimal(value).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else _fixed(seconds * 1000)


def _expected(fleet: Fleet) -> dict[str, str]:
    """What the page must show, from ``/metrics`` now (formatted as the page does)."""
    router = samples(fleet.router.url + "/metrics")
    requests = by_label(router, "kvserve_router_requests_total", "worker")
    in_flight = by_label(router, "kvserve_router_in_flight_requests", "worker")
    prefill = by_label(router, "kvserve_router_in_flight_prefill_tokens", "worker")
    ttft_sum = by_label(router, "kvserve_router_ttft_seconds_sum", "worker")
    ttft_count = by_label(router, "kvserve_router_ttft_seconds_count", "worker")
    ttft_buckets = _ttft_buckets(router)
    expected: dict[str, str] = {}
    totals = {"used": 0.0, "cached": 0.0, "total": 0.0, "hit": 0.0, "queried": 0.0}
    for index, worker in enumerate(fleet.workers):
        wid = f"w{index}"
        exposed = samples(worker.url + "/metrics", AUTH)
        engine = {name: value for (name, labels), value in exposed.items() if not labels}
        hit = engine["kvserve_prefix_cache_hit_tokens_total"]
        queried = engine["kvserve_prefix_cache_queried_tokens_total"]
        assert engine["kvserve_kv_tier_host_capacity_blocks"] == HOST_CACHE_BLOCKS
        expected |= {
            f"{wid}/health": "up · closed",
            f"{wid}/in_flight_requests": f"{in_flight.get(wid, 0):.0f}",
            f"{wid}/in_flight_prefill_tokens": f"{prefill.get(wid, 0):.0f}",
            f"{wid}/requests": f"{requests.get(wid, 0):.0f}",
            f"{wid}/errors": "0",
            f"{wid}/ttft_mean_ms": _ms(ttft_sum[wid] / ttft_count[wid]),
            f"{wid}/ttft_p99_ms": _ms(histogram_quantile(0.99, ttft_buckets[wid])),
            f"{wid}/running": f"{engine['kvserve_num_requests_running']:.0f}",
            f"{wid}/waiting": f"{engine['kvserve_num_requests_waiting']:.0f}",
            f"{wid}/blocks_used": f"{engine['kvserve_kv_blocks_used']:.0f}",
            f"{wid}/blocks_cached": f"{engine['kvserve_kv_blocks_cached']:.0f}",
            f"{wid}/blocks_free": f"{engine['kvserve_kv_blocks_free']:.0f}",
            f"{wid}/blocks_total": f"{engine['kvserve_kv_blocks_total']:.0f}",
            f"{wid}/host_tier": f"{engine['kvserve_kv_tier_host_blocks']:.0f} / "
            f"{engine['kvserve_kv_tier_host_capacity_blocks']:.0f}",
            f"{wid}/hit_rate": f"{_fixed(hit / queried * 100)}%" if queried else "–",
            f"{wid}/hit_tokens": f"{hit:.0f} / {queried:.0f}",
        }
        totals["used"] += engine["kvserve_kv_blocks_used"]
        totals["cached"] += engine["kvserve_kv_blocks_cached"]
        totals["total"] += engine["kvserve_kv_blocks_total"]
        totals["hit"] += hit
        totals["queried"] += queried
    bounds = [le for le, _ in ttft_buckets["w0"]]
    fleet_buckets = [(le, sum(dict(b)[le] for b in ttft_buckets.values())) for le in bounds]
    expected |= {
        "fleet/workers": f"{len(fleet.workers)} / {len(fleet.workers)}",
        "fleet/in_flight_requests": f"{sum(in_flight.values()):.0f}",
        "fleet/in_flight_prefill_tokens": f"{sum(prefill.values()):.0f}",
        "fleet/requests": f"{sum(requests.values()):.0f}",
        "fleet/errors": "0",
        "fleet/ttft_mean_ms": _ms(sum(ttft_sum.values()) / sum(ttft_count.values())),
        "fleet/ttft_quantiles_ms": f"{_ms(histogram_quantile(0.5, fleet_buckets))} / "
        f"{_ms(histogram_quantile(0.99, fleet_buckets))}",
        "fleet/blocks_used": f"{totals['used']:.0f} / {totals['total']:.0f}",
        "fleet/blocks_cached": f"{totals['cached']:.0f}",
        "fleet/hit_rate": f"{_fixed(totals['hit'] / totals['queried'] * 100)}%",
    }
    for (name, labels), value in router.items():
        if name == "kvserve_router_decisions_total":
            label = dict(labels)
            expected[f"decision/{label['policy']}/{label['reason']}"] = f"{value:.0f}"
    return expected


def _shown_once_settled(page: Page, fleet: Fleet) -> tuple[dict[str, str], dict[str, str]]:
    """The page's numbers and ``/metrics``' once they agree, or the last of both after
    ``RENDER_TIMEOUT_MS``. The page lags ``/metrics`` by up to a refresh and a worker
    scrape (a second each), so each render is compared with ``/metrics`` read just before."""
    deadline = time.monotonic() + RENDER_TIMEOUT_MS / 1000
    while True:
        expected = _expected(fleet)
        _wait_for_renders(page, 1)
        shown = {key: text for key, text in page.evaluate(COLLECT_SHOWN).items() if key in expected}
        if shown == expected or time.monotonic() > deadline:
            return shown, expected


def test_dashboard_shows_what_metrics_say(fleet: Fleet, browser: Browser, tmp_path: Path) -> None:
    context = browser.new_context(
        http_credentials={"username": "operator", "password": ADMIN_KEY},
        viewport={"width": 1600, "height": 900},
    )
    try:
        page = context.new_page()
        script_errors: list[str] = []
        page.on("pageerror", lambda error: script_errors.append(str(error)))
        page.on("console", lambda m: script_errors.append(m.text) if m.type == "error" else None)
        page.goto(fleet.router.url + "/dashboard")
        served = []
        for question in ("What is a block?", "What is a tier?", "Why route by prefix?"):
            _wait_for_renders(page, 2)  # rounds a sample or more apart: the charts have a history
            served += _send_round(fleet, question)
        assert {worker for worker, _ in served} == {"w0", "w1"}

        shown, expected = _shown_once_settled(page, fleet)
        assert shown == expected

        recent = page.evaluate(COLLECT_RECENT)
        assert [tuple(row) for row in recent[: len(served)]] == served[::-1]
        lines = page.locator("#chart-requests polyline").count()
        assert lines >= 1, "the requests chart drew nothing"

        screenshot = Path(os.environ.get("KVSERVE_DASHBOARD_SCREENSHOT", tmp_path / "dash.png"))
        page.screenshot(path=str(screenshot), full_page=True)
        assert screenshot.stat().st_size > 10_000
        assert not script_errors
    finally:
        context.close()
