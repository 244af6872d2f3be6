"""What a kvserve worker's ``/metrics`` says about its KV cache, read by the router for the
dashboard. ``/load`` lacks the prefix-cache and tier counters, and ``/metrics`` is the
contract Prometheus already relies on, so the dashboard shows the same numbers."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

_TIER_PREFIX = "kvserve_kv_tier_"


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One scrape of one worker. Counters are cumulative since the worker started."""

    running: int
    waiting: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    blocks_total: int
    prefill_tokens: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    generation_tokens: int
    preemptions: int
    tiers: dict[str, int]  # kvserve_kv_tier_* without prefix (unlabelled ones), if tiers are on
    scraped_at: float  # wall-clock time of the scrape

    def describe(self) -> dict[str, object]:
        """The dashboard's ``kv`` object of a worker."""
        queried = self.prefix_queried_tokens
        return {
            "running": self.running,
            "waiting": self.waiting,
            "prefill_tokens": self.prefill_tokens,
            "blocks": {
                "used": self.blocks_used,
                "cached": self.blocks_cached,
                "free": self.blocks_free,
                "total": self.blocks_total,
            },
            "host_tier": (
                {
                    "blocks": self.tiers.get("host_blocks", 0),
                    "capacity": self.tiers.get("host_capacity_blocks", 0),
                }
                if self.tiers.get("host_capacity_blocks")
                else None
            ),
            "storage_tier_written_blocks": self.tiers.get("storage_written_blocks_total"),
            "prefix_cache": {
                "queried_tokens": queried,
                "hit_tokens": self.prefix_hit_tokens,
                "hit_rate": self.prefix_hit_tokens / queried if queried else None,
            },
            "generation_tokens": self.generation_tokens,
            "preemptions": self.preemptions,
            "scraped_at": self.scraped_at,
        }


def parse_worker_metrics(text: str, scraped_at: float) -> WorkerReport:
    """Read the unlabelled samples the dashboard needs; raises KeyError when ``text`` is
    not a kvserve worker's exposition (a foreign OpenAI server's, say)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                values[sample.name] = sample.value

    def read(name: str) -> int:
        return int(values[name])

    return WorkerReport(
        running=read("kvserve_num_requests_running"),
        waiting=read("kvserve_num_requests_waiting"),
        blocks_used=read("kvserve_kv_blocks_used"),
        blocks_cached=read("kvserve_kv_blocks_cached"),
        blocks_free=read("kvserve_kv_blocks_free"),
        blocks_total=read("kvserve_kv_blocks_total"),
        prefill_tokens=read("kvserve_prefill_tokens_in_flight"),
        prefix_queried_tokens=read("kvserve_prefix_cache_queried_tokens_total"),
        prefix_hit_tokens=read("kvserve_prefix_cache_hit_tokens_total"),
        generation_tokens=read("kvserve_generation_tokens_total"),
        preemptions=read("kvserve_num_preemptions_total"),
        tiers={
            name.removeprefix(_TIER_PREFIX): int(value)
            for name, value in values.items()
            if name.startswith(_TIER_PREFIX)
        },
        scraped_at=scraped_at,
    )


class NoReport(Enum):
    """Why a scrape gave no report. The two differ in what to do next: a worker that did
    not answer may answer the next second, while one that answered with another server's
    exposition (a vLLM or SGLang worker) will answer the same way every time."""

    SILENT = "silent"
    FOREIGN = "foreign"


async def scrape_worker(
    session: aiohttp.ClientSession, url: str, timeout_s: float, now: float
) -> WorkerReport | NoReport:
    """The worker's report, or why there is none: the dashboard then shows the router's
    own figures for that worker."""
    try:
        async with session.get(
            url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            if response.status != 200:
                return NoReport.SILENT
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return NoReport.SILENT
    try:
        return parse_worker_metrics(text, now)
    except (KeyError, ValueError):
        return NoReport.FOREIGN
