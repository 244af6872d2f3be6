"""Reading Prometheus text exposition in tests, without a parser dependency."""

from __future__ import annotations

import re
import time
import urllib.request

_SAMPLE = re.compile(r"^(\w+)(?:\{([^}]*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def samples(
    url: str, headers: dict[str, str] | None = None
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample at ``url`` (a /metrics endpoint): (name, labels) -> value."""
    return _fetch(url, headers)[1]


def samples_of_every_process(
    url: str, processes: int, within_s: float = 20.0
) -> list[dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    """Each process's samples at a ``--processes N`` router's ``url`` (its counters are the
    router's sums; its gauges, e.g. indexed blocks, its own view). Fetched on fresh
    connections (which the kernel spreads over the processes) until every one answered."""
    found: dict[str, dict[tuple[str, frozenset[tuple[str, str]]], float]] = {}
    deadline = time.monotonic() + within_s
    while len(found) < processes:
        assert time.monotonic() < deadline, f"only processes {sorted(found)} answered"
        process, answer = _fetch(url)
        found[process or "0"] = answer
    return list(found.values())


def _fetch(
    url: str, headers: dict[str, str] | None = None
) -> tuple[str | None, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    """The answering router process (None with one) and the samples."""
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=5.0) as response:
        text = response.read().decode()
        process = response.headers.get("x-kvserve-router-process")
    found = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            found[(name, frozenset(_LABEL.findall(labels or "")))] = float(value)
    return process, found


def by_label(
    all_samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, label: str
) -> dict[str, float]:
    """One metric's values keyed by one label's value, e.g. per worker."""
    return {
        dict(labels)[label]: value
        for (metric, labels), value in all_samples.items()
        if metric == name and label in dict(labels)
    }


def wait_until_indexed(
    router_url: str, worker_id: str | None = None, timeout_s: float = 20.0
) -> None:
    """Poll until the router's KV index holds device blocks that a worker's own events
    reported (``worker_id``'s, or any worker's): what follows may rely on them."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {
            dict(labels)["worker"]: value
            for (name, labels), value in samples(router_url + "/metrics").items()
            if name == "kvserve_router_kv_index_blocks" and ("tier", "device") in labels
        }
        if any(v > 0 for w, v in held.items() if worker_id in (None, w)):
            return
        assert time.monotonic() < deadline, f"the router's index never held blocks: {held}"
        time.sleep(0.05)
