"""Choosing among workers that a policy considers equally good."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvserve.core.routing.types import WorkerLoad, sort_key_of


class Rotation:
    """Rotates among tied workers.

    Taking the first of a tie sends every cache miss of an idle fleet to the same worker
    (a known bug of the established gateways); rotating spreads them.
    """

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, tied: Sequence[WorkerLoad]) -> WorkerLoad:
        choice = tied[self._turn % len(tied)]
        self._turn += 1
        return choice


def least_loaded(workers: Sequence[WorkerLoad], rotation: Rotation) -> WorkerLoad:
    """The least-loaded worker (by ``WorkerLoad.sort_key``); ties rotate. One plain loop:
    it runs on every request, where generators cost more than the comparisons."""
    lightest: tuple[int, int] | None = None
    tied: list[WorkerLoad] = []
    for worker in workers:
        key = sort_key_of(worker)
        if lightest is None or key < lightest:
            lightest, tied = key, [worker]
        elif key == lightest:
            tied.append(worker)
    return rotation.pick(tied)


class PoolRotations(dict[str, Rotation]):
    """One rotation per pool: a pair choice picks in two pools per request, and one
    shared turn would then advance by two each time and pin ties to the same workers."""

    def __missing__(self, pool: str) -> Rotation:
        rotation = self[pool] = Rotation()
        return rotation


class ReplicaSalt:
    """A small fixed score offset per (router replica, worker), in ``[0, spread_s)``.

    Router replicas with the same index and loads rank workers alike: a burst of requests
    arriving at one instant, split over the replicas, goes to the same best worker from
    each before any replica hears the others' announcements. Offsetting each replica's
    scores by a different deterministic amount per worker makes near-equal choices differ
    across replicas while a win by more than ``spread_s`` stands; the offsets are a hash,
    so a replica's choices are reproducible and another replica can compute them.
    """

    def __init__(self, replica: str, spread_s: float) -> None:
        if spread_s < 0:
            raise ValueError("spread_s must be >= 0")
        self.replica = replica
        self.spread_s = spread_s
        self._offsets: dict[str, float] = {}

    def __call__(self, worker_id: str) -> float:
        offset = self._offsets.get(worker_id)
        if offset is None:
            digest = xxhash.xxh3_64_intdigest(f"{self.replica}/{worker_id}".encode())
            offset = self._offsets[worker_id] = self.spread_s * digest / 2**64
        return offset
