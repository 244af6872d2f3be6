"""Choosing among workers that a policy considers equally good."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.routing.types import WorkerLoad


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
    """The least-loaded worker; ties rotate."""
    lightest = min(w.sort_key for w in workers)
    return rotation.pick([w for w in workers if w.sort_key == lightest])


class PoolRotations(dict[str, Rotation]):
    """One rotation per pool: a pair choice picks in two pools per request, and one
    shared turn would then advance by two each time and pin ties to the same workers."""

    def __missing__(self, pool: str) -> Rotation:
        rotation = self[pool] = Rotation()
        return rotation
