"""What the scheduler asks and tells the components that move KV in and out of the pool.

KV tiers (host memory, shared storage) and prefill/decode disaggregation hold state per
request beside the scheduler: blocks loading for a waiting request, a reservation a
request takes over, a preempted request's blocks to save. The scheduler is handed one
:class:`SchedulerConnector` at construction and calls it at the four moments of a
request's life that concern KV; several are combined with :class:`SchedulerConnectors`.
Implementations may do I/O; this interface and the scheduler stay pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvserve.core.request import Request


class SchedulerConnector(Protocol):
    """The scheduler's side of a KV connector; every call is on the scheduler's thread."""

    def request_added(self, request: Request) -> None:
        """``request`` was queued (e.g. it takes over blocks reserved under its id)."""

    def may_admit(self, request: Request) -> bool:
        """May the scheduler admit this waiting request now? False while KV it should
        start from is still loading: it keeps its place and later requests may go."""

    def before_preempt(self, request: Request) -> None:
        """``request`` is about to be preempted; its blocks still hold what it computed
        (e.g. to save them before eviction may reuse them)."""

    def request_finished(self, request: Request) -> None:
        """``request`` left the scheduler (finished, aborted or rejected): drop what is
        held for it."""


class SchedulerConnectors:
    """Several connectors as one: each is told every event, in order; admission needs
    every one's consent, and the first that refuses ends the asking (later ones would
    only start work for a request that cannot go now)."""

    def __init__(self, connectors: Sequence[SchedulerConnector]) -> None:
        self._connectors = tuple(connectors)

    def request_added(self, request: Request) -> None:
        for connector in self._connectors:
            connector.request_added(request)

    def may_admit(self, request: Request) -> bool:
        return all(connector.may_admit(request) for connector in self._connectors)

    def before_preempt(self, request: Request) -> None:
        for connector in self._connectors:
            connector.before_preempt(request)

    def request_finished(self, request: Request) -> None:
        for connector in self._connectors:
            connector.request_finished(request)
