"""A pool's loads as a policy reads them, kept between decisions instead of listed per
request.

A policy is given the loads of the pool's accepting workers. Listing them for every
request, one tracker read per worker, cost the real router ~185–280 µs a request at 1,000
workers, more than kv_aware's whole choice, which reads only the holders of a prefix and
a few light workers (docs/benchmarks.md, "The router's loads kept per pool"). A
:class:`PoolLoads` is that list kept: the router rebuilds it when the pool's accepting
workers change and patches one entry when a worker's load does. It is also each
worker's load by id, which kv_aware reads instead of indexing the list itself, and the
prefill tokens the pool's guards hold in all, which kv_aware reads to tell a fleet with
slack from one under load (:func:`guarded_prefill_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import overload

from kvserve.core.routing.types import WorkerLoad


class PoolLoads(Sequence[WorkerLoad]):
    """The loads of a pool's accepting workers, in the pool's order; ``by_id`` maps each
    worker id to the same load. Read-only to policies: only :meth:`replace` changes it."""

    __slots__ = ("_by_id", "_loads", "_position", "prefill_tokens")

    def __init__(self, loads: Iterable[WorkerLoad]) -> None:
        self._loads = list(loads)
        self._position = {load.worker_id: i for i, load in enumerate(self._loads)}
        if len(self._position) != len(self._loads):
            raise ValueError("a pool lists each worker once")
        self._by_id = {load.worker_id: load for load in self._loads}
        # every worker's guarded prefill tokens, this router's and its peers', summed
        self.prefill_tokens = sum(map(_guarded_tokens, self._loads))

    @property
    def by_id(self) -> Mapping[str, WorkerLoad]:
        return self._by_id

    def replace(self, load: WorkerLoad) -> None:
        """``load`` is now its worker's load, if the worker is in the pool."""
        position = self._position.get(load.worker_id)
        if position is not None:
            self.prefill_tokens += _guarded_tokens(load) - _guarded_tokens(self._loads[position])
            self._loads[position] = load
            self._by_id[load.worker_id] = load

    @overload
    def __getitem__(self, index: int) -> WorkerLoad: ...

    @overload
    def __getitem__(self, index: slice) -> list[WorkerLoad]: ...

    def __getitem__(self, index: int | slice) -> WorkerLoad | list[WorkerLoad]:
        return self._loads[index]

    def __len__(self) -> int:
        return len(self._loads)

    def __iter__(self) -> Iterator[WorkerLoad]:
        return iter(self._loads)  # Sequence's own would index one position at a time


def loads_by_id(loads: Sequence[WorkerLoad]) -> Mapping[str, WorkerLoad]:
    """Each worker's load by id: kept in a :class:`PoolLoads`, else made here."""
    if isinstance(loads, PoolLoads):
        return loads.by_id
    return {load.worker_id: load for load in loads}


def guarded_prefill_tokens(loads: Sequence[WorkerLoad]) -> int:
    """The prefill tokens held on ``loads``' workers by this router's guards and, as they
    reported, by its peers': kept in a :class:`PoolLoads`, else summed here."""
    if isinstance(loads, PoolLoads):
        return loads.prefill_tokens
    return sum(map(_guarded_tokens, loads))


def _guarded_tokens(load: WorkerLoad) -> int:
    return load.in_flight_prefill_tokens + load.others_prefill_tokens
