"""KV connectors: components that move KV in and out of one engine's pool.

KV tiers (host memory, shared storage) and both halves of prefill/decode disaggregation
are connectors. The engine is handed a factory per connector at construction and builds
each with a :class:`ConnectorContext`, the few engine objects a connector may use; it
then hands every connector to the scheduler (the
:class:`~kvserve.core.kv_connector.SchedulerConnector` hooks) and calls the engine hooks
below around each step. A connector reaches nothing else of the engine, and the engine
knows nothing of what a connector does: a new one (another store, another transfer)
plugs in without touching either.

Every hook runs on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import EventLog
from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.kv_block_io import KVBlockLayout
from kvserve.engine.kv_pool import KVPool

TierBlocks = list[tuple[int, int | None]]  # (hash, parent hash), parents first


@dataclass(frozen=True, slots=True)
class ConnectorContext:
    """What a connector gets of its engine."""

    kv_cache: KVCacheManager
    events: EventLog  # the engine's KV events, which a connector's tiers extend
    namespace: bytes  # of the engine's block hashes
    max_model_len: int
    kv_pool: KVPool | None  # None: the runner stands in for a model and holds no KV
    layout: KVBlockLayout | None

    def require_pool(self, what: str) -> tuple[KVPool, KVBlockLayout]:
        """The KV pool and its layout, or ``ValueError`` naming ``what`` needs them."""
        if self.kv_pool is None or self.layout is None:
            raise ValueError(f"{what} need the model runner's KV pool")
        return self.kv_pool, self.layout


@dataclass(frozen=True, slots=True)
class QueueView:
    """The scheduler's queues as a connector may read them before a step."""

    running: Sequence[Request]
    waiting: Sequence[Request]


class KVConnector:
    """Both sides of a connector, every hook a no-op: a connector overrides what it uses.

    Scheduler side (see :class:`~kvserve.core.kv_connector.SchedulerConnector`):
    ``request_added``, ``may_admit``, ``before_preempt``, ``request_finished``.
    """

    # -- scheduler side ------------------------------------------------------------

    def request_added(self, request: Request) -> None:
        pass

    def may_admit(self, request: Request) -> bool:
        return True

    def before_preempt(self, request: Request) -> None:
        pass

    def request_finished(self, request: Request) -> None:
        pass

    # -- engine side -----------------------------------------------------------------

    def before_step(self, queues: QueueView) -> None:
        """Before the scheduler plans the step: install what arrived, announce what
        completed."""

    def after_step(self, plan: SchedulerOutput) -> list[str]:
        """The model computed ``plan`` and full blocks are committed; no request of it has
        finished yet, so every block table is still readable. Returns the requests this
        connector is done with: the engine drops them after the step, without output."""
        return []

    def step_failed(self, error: Exception) -> list[str]:
        """The step raised ``error``; returns the requests to drop (as ``after_step``)."""
        return []

    def metrics(self) -> dict[str, int]:
        """Counters and gauges for the worker's ``/metrics`` (names without prefix)."""
        return {}

    def snapshot(self) -> dict[str, TierBlocks]:
        """Blocks of the tiers this connector publishes events for, by tier, consistent
        with the event log's ``last_seq`` when taken on the engine thread."""
        return {}

    def shared_store(self) -> str | None:
        """The name of the KV store other workers also load from, which this
        connector's ``storage`` events describe (None: none)."""
        return None

    def check(self) -> None:
        """Raise :class:`~kvserve.core.invariants.InvariantError` if this connector's
        state is inconsistent (tests, ``/debug/check``)."""

    def close(self) -> None:
        """Stop background threads; the engine is not stepped again."""


ConnectorFactory = Callable[[ConnectorContext], KVConnector]
