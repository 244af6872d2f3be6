"""The one interface every routing policy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad


class Policy(ABC):
    """Picks one of the available workers for a request.

    Pure: no I/O, the time is passed in, so the simulator can drive the same objects.
    ``workers`` is non-empty and holds only workers that may take traffic now.
    """

    name: ClassVar[str]

    @abstractmethod
    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision: ...

    async def prepare(self, query: RouteQuery) -> RouteQuery:
        """The query ``select`` will see, after any slow work that must not block the
        router's event loop (kv_aware tokenizes here). Awaited once per request, before
        any load guard is taken, so a client leaving meanwhile leaves nothing held."""
        return query

    def forget_worker(self, worker_id: str) -> None:  # noqa: B027 - most policies keep no state
        """Drop what the policy learned about a worker that left the fleet."""
