"""``/metrics`` of a router of several processes: the whole router's counts, whichever
process the scrape reaches.

With ``--processes N`` the kernel hands each scrape's connection to one process, and each
process counts only what it served. A Prometheus server scraping the port would see
counters jump between the processes' values (read as resets, rates wrong by N×). So the
process that gets the scrape asks every sibling, over the links the processes already
share, for its counters and histograms, and answers their sum. Gauges are not summed:
the in-flight gauges already read the shared table (the fleet's totals), and the others
(worker health, indexed blocks) are each process's own view of the same workers, so the
answering process's value is the router's.

A sibling that does not answer within ``timeout_s`` (stuck, or stopping) is left out and
the scrape says so in ``kvserve_router_metrics_processes_answered``, rather than the
scrape hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvserve.router.sibling_links import SiblingLinks

log = logging.getLogger(__name__)

_REQUEST = "metrics_request"
_REPLY = "metrics_reply"
_SUMMED = frozenset({"counter", "histogram"})

# The wire form of a family: [name, type, documentation, [[sample name, labels, value]]].
FamilyJson = list[Any]


def families_json(registry: CollectorRegistry) -> list[FamilyJson]:
    """The summed kinds of ``registry``'s families, in a form the links can carry."""
    return [
        [family.name, family.type, family.documentation, [list(s[:3]) for s in family.samples]]
        for family in registry.collect()
        if family.type in _SUMMED
    ]


def summed(own: Iterable[Metric], siblings: Iterable[list[FamilyJson]]) -> list[Metric]:
    """``own`` families with every sibling's counter and histogram samples added in; a
    family or labelled series only a sibling has is added as it is."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for family in own:
        families[family.name] = family
        values[family.name] = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples
        }
    for name, kind, documentation, samples in itertools.chain.from_iterable(siblings):
        if name not in families:
            families[name] = Metric(name, documentation, kind)
            values[name] = {}
        if families[name].type not in _SUMMED:
            continue
        series = values[name]
        for sample_name, labels, value in samples:
            key = (sample_name, tuple(sorted(labels.items())))
            series[key] = series.get(key, 0.0) + value
    merged = []
    for name, family in families.items():
        if family.type in _SUMMED:
            out = Metric(name, family.documentation, family.type)
            for (sample_name, labels), value in values[name].items():
                out.add_sample(sample_name, dict(labels), value)
            family = out
        merged.append(family)
    return merged


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


class SiblingMetrics:
    """Answers the siblings' requests for this process's counts, and renders the
    router's total for a scrape this process got."""

    def __init__(
        self, links: SiblingLinks, registry: CollectorRegistry, timeout_s: float = 2.0
    ) -> None:
        self._links = links
        self._registry = registry
        self._timeout_s = timeout_s
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[asyncio.Future[None], list[list[FamilyJson]]]] = {}

    def on_message(self, message: object, link: int) -> bool:
        """Handle a metrics request or reply from ``link``; False for any other message."""
        if not isinstance(message, dict):
            return False
        if _REQUEST in message:
            self._links.send_to(
                link, {_REPLY: message[_REQUEST], "families": families_json(self._registry)}
            )
            return True
        if _REPLY in message:
            waiting = self._waiting.get(message[_REPLY])
            if waiting is not None:  # else: it came after its scrape gave up on it
                done, replies = waiting
                replies.append(message["families"])
                if len(replies) == self._links.count and not done.done():
                    done.set_result(None)
            return True
        return False

    async def render(self) -> bytes:
        """The exposition of this process's metrics with every sibling's counts added."""
        families, answered = await self.families()
        answered_gauge = GaugeMetricFamily(
            "kvserve_router_metrics_processes_answered",
            "Router processes whose counts this scrape sums (this one included).",
            value=answered,
        )
        return generate_latest(_Families([*families, answered_gauge]))

    async def families(self) -> tuple[list[Metric], int]:
        """This process's families with every sibling's counts added, and how many
        processes answered (this one included)."""
        request = next(self._ids)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        replies: list[list[FamilyJson]] = []
        self._waiting[request] = (done, replies)
        try:
            self._links.send({_REQUEST: request})
            await asyncio.wait_for(asyncio.shield(done), self._timeout_s)
        except TimeoutError:
            log.warning(
                "/metrics: %d of %d sibling processes answered within %.1f s",
                len(replies),
                self._links.count,
                self._timeout_s,
            )
        finally:
            del self._waiting[request]
        return summed(self._registry.collect(), list(replies)), 1 + len(replies)
