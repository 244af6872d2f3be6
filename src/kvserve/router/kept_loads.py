"""Each pool's loads as the policy reads them, kept between requests.

Listing the accepting workers' loads for every request was O(workers) on the request
path whatever the policy reads (~185–280 µs at 1,000 workers); kept, a request costs nothing
here and a change of load one dict write (see :mod:`kvserve.core.routing.pool_loads`).
The view is exact only if every change of a load is told to :meth:`KeptPoolLoads.changed`:
this router's guards and its peers' announced loads are; a sibling process's guards
(``--processes N``) change a shared table without telling, so the router keeps no view
there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvserve.core.routing.pool_loads import PoolLoads
from kvserve.core.routing.types import WorkerLoad
from kvserve.router.worker_registry import Worker


class KeptPoolLoads:
    """The :class:`PoolLoads` of each pool's accepting workers: made again when the
    registry's accepting tuple for the pool is a new object (a worker joined, left, or
    changed health), patched when one worker's load changes."""

    def __init__(self, read: Callable[[str], WorkerLoad]) -> None:
        self._read = read
        self._pools: dict[str, tuple[Sequence[Worker], PoolLoads]] = {}

    def of(self, pool: str, workers: Sequence[Worker]) -> PoolLoads:
        """The loads of ``workers``, the registry's accepting workers of ``pool``."""
        kept = self._pools.get(pool)
        if kept is not None and kept[0] is workers:
            return kept[1]
        loads = PoolLoads(self._read(worker.worker_id) for worker in workers)
        self._pools[pool] = (workers, loads)
        return loads

    def changed(self, load: WorkerLoad) -> None:
        """``load`` is its worker's load now."""
        for _, loads in self._pools.values():
            loads.replace(load)
