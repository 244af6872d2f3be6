"""The KV tiers as one KV connector: host memory and a shared store below the device.

Every hook runs on the engine's thread: the scheduler asks :meth:`KVTiers.may_admit`
before it admits a waiting request (:mod:`.admission`) and tells of preemptions and of
requests that leave (:mod:`.offload`); before a step completed storage writes are
announced (:mod:`.announcements`) and finished loads collected; after a step completed
blocks are offered to the tiers. Storage I/O runs on two background threads
(:mod:`kvserve.engine.kv_offload`) behind the :class:`~kvserve.engine.storage.KVStorage`
interface a backend implements.
"""

from __future__ import annotations

from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.host_kv_pool import HostKVPool
from kvserve.engine.kv_connector import (
    ConnectorContext,
    ConnectorFactory,
    KVConnector,
    QueueView,
    TierBlocks,
)
from kvserve.engine.kv_offload import FaultLog, StorageLoader, StorageWriter
from kvserve.engine.kv_tier_config import KVTierConfig
from kvserve.engine.kv_tiers.admission import TierAdmissions
from kvserve.engine.kv_tiers.announcements import StorageAnnouncements
from kvserve.engine.kv_tiers.offload import TierOffload
from kvserve.engine.kv_tiers.storage_writes import StorageWrites
from kvserve.engine.kv_tiers.tier_stats import TierStats
from kvserve.engine.storage.base import KVStorage, open_storage
from kvserve.engine.storage.block_codec import namespace_of
from kvserve.engine.storage.identity import store_identity

FAULT_PREFIX = "fault_"  # metrics() names of fault counts: fault_read, fault_write, ...
GAUGES = frozenset({"host_blocks", "host_capacity_blocks"})  # the rest of metrics() count


def kv_tiers(config: KVTierConfig) -> ConnectorFactory:
    """The factory an engine builds its tiers with."""
    return lambda context: KVTiers(context, config)


class KVTiers(KVConnector):
    """The host and storage tiers of one engine, and the hooks that move blocks."""

    def __init__(self, context: ConnectorContext, config: KVTierConfig) -> None:
        pool, layout = context.require_pool("KV tiers")
        self._cache = context.kv_cache
        host_blocks = config.host_blocks_for(layout.block_nbytes)
        self.host = HostKVPool(layout, host_blocks, context.events) if host_blocks else None
        self.faults = FaultLog()
        self.stats = TierStats()
        self._storage: KVStorage | None = None
        self._writer: StorageWriter | None = None
        self._loader: StorageLoader | None = None
        self._announcements: StorageAnnouncements | None = None
        writes: StorageWrites | None = None
        self._store_identity: str | None = None
        if config.storage:
            namespace = namespace_of(layout)
            self._storage = open_storage(
                config.storage, namespace, max_bytes=config.storage_max_bytes
            )
            self._store_identity = store_identity(config.storage, namespace, name=config.storage_id)
            self._writer = StorageWriter(
                self._storage, layout, self.faults, config.max_pending_writes
            )
            self._loader = StorageLoader(self._storage, layout, self.faults)
            writes = StorageWrites(self._writer)
            self._announcements = StorageAnnouncements(writes, self.faults, context.events)
        self._admissions = TierAdmissions(
            self._cache, pool, layout, self.host, self._loader, self.stats
        )
        self._offload = TierOffload(
            self._cache, pool, layout, self.host, writes, config.min_hits,
            self._admissions, self.stats,
        )  # fmt: skip

    # -- scheduler side ------------------------------------------------------------

    def may_admit(self, request: Request) -> bool:
        return self._admissions.may_admit(request)

    def before_preempt(self, request: Request) -> None:
        self._offload.before_preempt(request)

    def request_finished(self, request: Request) -> None:
        self._admissions.forget(request.request_id)
        self._offload.forget(request.request_id)

    # -- engine side -----------------------------------------------------------------

    def before_step(self, queues: QueueView) -> None:
        if self._announcements is not None:
            self._announcements.announce()
        self._admissions.collect(queues)

    def after_step(self, plan: SchedulerOutput) -> list[str]:
        self._offload.after_step(plan)
        return []

    def metrics(self) -> dict[str, int]:
        values = {name: getattr(self.stats, name) for name in TierStats.__slots__}
        values["host_blocks"] = len(self.host.index) if self.host else 0
        values["host_capacity_blocks"] = self.host.capacity if self.host else 0
        if self._writer is not None:
            values["storage_written_blocks"] = self._writer.written_blocks
            values["storage_dropped_blocks"] = self._writer.dropped_blocks
            values["storage_failed_blocks"] = self._writer.failed_blocks
        for kind, count in self.faults.snapshot().items():
            values[f"{FAULT_PREFIX}{kind}"] = count
        return values

    def snapshot(self) -> dict[str, TierBlocks]:
        """``host``: the host index; ``storage``: what this worker's events announced."""
        tiers: dict[str, TierBlocks] = {}
        if self.host is not None:
            tiers["host"] = self.host.index.snapshot()
        if self._announcements is not None:
            tiers["storage"] = self._announcements.snapshot()
        return tiers

    def shared_store(self) -> str | None:
        return self._store_identity

    def check(self) -> None:
        """The device ledger's invariants (blocks loaded for a request included) and the
        host index's."""
        self._cache.check()
        if self.host is not None:
            self.host.index.check()

    def close(self) -> None:
        """Finish queued writes (for a few seconds at most) and stop the threads."""
        for thread in (self._writer, self._loader):
            if thread is not None:
                thread.close()
        if self._storage is not None:
            self._storage.close()
