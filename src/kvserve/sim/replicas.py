"""Router replicas in the simulator: each routes its share of requests with its own
policy object and its own guards, all fed the same KV events.

A large fleet runs several router replicas behind one address. Each sees its own
in-flight load exactly (its guards) and nothing of the others': R replicas each believe a
worker is idle while together they queue R requests on it. What a replica can learn of
the others' load is what workers report. The model: every ``load_report_interval_s``
each worker reports what is in flight on it (all replicas' guards, exactly as they
stand), and a replica's view of a worker is its own guards now plus the others' part of
the last report (the report less what the replica itself held then): their requests
added to its own, their prefill tokens apart (``WorkerLoad.others_prefill_tokens``),
since kv_aware weighs its own prefill queue against its own guards and must add the
others' queue, not hide it behind a minimum. Without reports (``None``) a replica sees
its own guards only, the fragmentation to measure; with 0, every worker reports before
each decision (replicas that announce each choice to the others at once).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.routing.policy import Policy
from kvserve.core.routing.types import WorkerLoad


class RouterReplica:
    """One replica's policy and load view, told to its policy on every change as the
    router's :class:`~kvserve.router.load_guard.LoadTracker` does."""

    def __init__(self, policy: Policy, worker_ids: Sequence[str]) -> None:
        self.policy = policy
        self.requests = dict.fromkeys(worker_ids, 0)  # own guards
        self.prefill_tokens = dict.fromkeys(worker_ids, 0)
        self._others = {w: (0, 0) for w in worker_ids}  # the others' part of the last report

    def adjust(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        self.requests[worker_id] += requests
        self.prefill_tokens[worker_id] += prefill_tokens
        self.policy.observe_load(self._view(worker_id))

    def learn_report(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        """``worker_id`` reports ``requests`` and ``prefill_tokens`` in flight, of all
        replicas."""
        others = (
            requests - self.requests[worker_id],
            prefill_tokens - self.prefill_tokens[worker_id],
        )
        if others != self._others[worker_id]:
            self._others[worker_id] = others
            self.policy.observe_load(self._view(worker_id))

    def snapshot(self) -> list[WorkerLoad]:
        return [self._view(w) for w in self.requests]

    def _view(self, worker_id: str) -> WorkerLoad:
        other_requests, other_tokens = self._others[worker_id]
        return WorkerLoad(
            worker_id,
            self.requests[worker_id] + other_requests,
            self.prefill_tokens[worker_id],
            others_prefill_tokens=other_tokens,
        )
