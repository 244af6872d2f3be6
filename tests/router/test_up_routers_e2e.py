"""``kvserve up --routers 2``: two router replicas on consecutive ports, listed at start,
each the other's peer; requests through both are served and leave nothing held."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from tests.support.up_fleet import start_up


def test_up_starts_router_replicas_that_peer(tmp_path: Path) -> None:
    up = start_up(tmp_path, "--workers", "2", "--routers", "2", "--policy", "kv_aware")
    try:
        listed = re.search(r"router replicas \(.*\): (.*)$", up.log_tail(60), re.MULTILINE)
        assert listed is not None, up.log_tail(60)
        urls = [u.removesuffix("/v1") for u in listed.group(1).split()]
        assert urls[0] == up.url and len(urls) == 2
        deadline = time.monotonic() + 60
        while not all(
            httpx.get(url + "/peers", timeout=10).json()["peers"][0]["up"] for url in urls
        ):
            assert time.monotonic() < deadline, "the replicas never reached each other"
            time.sleep(0.1)
        for i, url in enumerate(urls):
            body = {"model": "tiny-llama", "prompt": f"hello from client {i}", "max_tokens": 2}
            response = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
        for url in urls:
            (peer,) = httpx.get(url + "/peers", timeout=10).json()["peers"]
            assert peer["url"] in urls and peer["url"] != url
        deadline = time.monotonic() + 60
        while any(
            w["in_flight_requests"] or w["peers_in_flight_requests"]
            for url in urls
            for w in httpx.get(url + "/workers", timeout=10).json()["workers"]
        ):
            assert time.monotonic() < deadline, "load still held"
            time.sleep(0.1)
    finally:
        up.stop()
