"""What keeping a request on its prefix's holder is worth later: discounted by the holder's
cache pressure.

kv_aware's ``recompute_weight`` charges a choice that is not the deepest holder for the
prefill it computes again (GPU time the requests behind it wait for). That charge only
buys something if the holder can serve the request from its cache soon. Two kinds of
cache pressure prevent it, and the weight a decision applies is the base weight times
the deepest holder's chance of escaping both:

- *Room.* The holder's cache is full of its running sequences' blocks, which cannot be
  evicted, so a new request waits for one of them to finish: a wait no prefill queue
  shows. Measured (agent sessions of 20–50k tokens on 200k-token caches, ×2 arrivals,
  weight 8 undiscounted): the worst requests were predicted 1–2 s, waited about 40 s,
  and found their cached blocks still there. The room is the cache (known once it
  evicts: what it holds then is all it can hold) less the prompts of the requests in
  flight there (the router's guards count them; this module remembers the prompt sizes
  it sent, most recent last). The chance is the share of the prompt that fits.
- *Retention.* A device cache that evicts least recently used blocks keeps an unused
  block for about the blocks it holds over the rate it evicts them (a full LRU cache of
  ``C`` blocks taking in ``r`` a second drops a block ``C / r`` seconds after its last
  use). The router sees both in the workers' KV events. A holder whose predicted wait is
  ``q`` keeps the prefix with a chance of ``1 − margin × q / retention`` (at least 0). On
  the traces measured, retention was 30 s and more against waits of a second or two, so
  this term changed little (docs/benchmarks.md); it is there for caches that turn over
  within a queue's wait.

A cache that evicts nothing has room and keeps everything: the full weight. A holder
under pressure is charged for nothing, and the request goes where its first token comes
soonest.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.types import WorkerLoad

_TIER = "device"


@dataclass(slots=True)
class _Evictions:
    """One worker's eviction rate: blocks removed per second, averaged exponentially."""

    sampled_at: float | None = None
    pending: int = 0  # removed since the last sample
    removed: float = 0.0  # decayed sum of removed blocks
    elapsed: float = 0.0  # decayed sum of the seconds they were counted over


class CacheTurnover:
    """Each worker's device-cache retention time, from its ``removed`` events.

    Events carry no time, so removals are counted as they come and turned into a rate
    when a decision asks (with the clock of that decision); the rate averages over about
    ``window_s`` seconds, so that one burst of evictions does not mark a worker as under
    pressure for good, nor a quiet second as free of it.
    """

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self._window_s = window_s
        self._workers: dict[str, _Evictions] = {}

    def observe(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """Count the device blocks ``worker_id`` evicted (a ``cleared`` tier is a restart,
        not pressure)."""
        removed = sum(
            len(e.block_hashes) for e in events if e.kind == "removed" and e.tier == _TIER
        )
        if removed:
            self._workers.setdefault(worker_id, _Evictions()).pending += removed

    def eviction_rate(self, worker_id: str, now: float) -> float:
        """Device blocks ``worker_id`` evicts per second lately (0: none seen)."""
        state = self._workers.get(worker_id)
        if state is None:  # not setdefault: that makes a state per decision to drop
            state = self._workers[worker_id] = _Evictions()
        if state.sampled_at is None:  # what came before has no known span: start here
            state.sampled_at = now
            state.pending = 0
            return 0.0
        dt = now - state.sampled_at
        if dt > 0 or state.pending:
            decay = math.exp(-max(dt, 0.0) / self._window_s)
            state.removed = state.removed * decay + state.pending
            state.elapsed = state.elapsed * decay + max(dt, 0.0)
            state.pending = 0
            state.sampled_at = max(now, state.sampled_at)
        return state.removed / state.elapsed if state.elapsed > 0 else 0.0

    def retention_s(self, worker_id: str, held_blocks: int, now: float) -> float:
        """About how long ``worker_id`` keeps a block nobody uses: ``inf`` if it evicts
        nothing."""
        rate = self.eviction_rate(worker_id, now)
        return held_blocks / rate if rate > 0 else math.inf

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)


def keep_chance(wait_s: float, retention_s: float, margin: float) -> float:
    """The chance a holder still has a prefix after ``wait_s`` seconds in its queue, for a
    cache that keeps an unused block ``retention_s`` seconds: a linear ramp from 1 (no
    wait, or no eviction) to 0 (the wait is ``1 / margin`` of the retention time)."""
    if math.isinf(retention_s):
        return 1.0
    if retention_s <= 0:
        return 0.0
    return max(0.0, 1.0 - margin * wait_s / retention_s)


@dataclass(frozen=True, slots=True)
class HolderPressure:
    """The parameters of the discount (see the module docstring)."""

    margin: float = 1.0
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ValueError("retention margin must be >= 0")
        if self.window_s <= 0:
            raise ValueError("retention window must be > 0")


class InFlightPrompts:
    """The prompt sizes this policy sent each worker, most recent last: the ``n`` latest
    stand for the ``n`` requests the guards say are in flight there (an approximation:
    requests need not finish in the order they came). ``keep`` sizes per worker are kept,
    more than a worker runs at once (its scheduler's sequence limit is in the hundreds),
    so that a fleet of thousands of workers costs megabytes, not hundreds of them."""

    def __init__(self, keep: int = 1024) -> None:
        self._keep = keep
        self._sent: dict[str, deque[int]] = {}

    def routed(self, worker_id: str, prompt_tokens: int) -> None:
        sent = self._sent.get(worker_id)
        if sent is None:
            sent = self._sent[worker_id] = deque(maxlen=self._keep)
        sent.append(prompt_tokens)

    def pinned_tokens(self, worker_id: str, in_flight: int) -> int:
        """Prompt tokens the ``in_flight`` requests on ``worker_id`` hold in its cache."""
        sent = self._sent.get(worker_id)
        if not sent or in_flight <= 0:
            return 0
        if in_flight >= len(sent):
            return sum(sent)
        return sum(sent[i] for i in range(len(sent) - in_flight, len(sent)))

    def forget(self, worker_id: str) -> None:
        self._sent.pop(worker_id, None)


def room_chance(capacity_tokens: float, pinned_tokens: int, prompt_tokens: int) -> float:
    """The share of a ``prompt_tokens`` prompt that fits beside the ``pinned_tokens`` of
    the running sequences in a cache of ``capacity_tokens``."""
    if math.isinf(capacity_tokens) or prompt_tokens <= 0:
        return 1.0
    return min(1.0, max(0.0, (capacity_tokens - pinned_tokens) / prompt_tokens))


class FutureCost:
    """The recompute weight one decision applies: ``base`` times the deepest holder's
    chance of still holding the prefix, and having room to run it, when it gets there."""

    def __init__(self, pressure: HolderPressure) -> None:
        self.pressure = pressure
        self.turnover = CacheTurnover(pressure.window_s)
        self.in_flight = InFlightPrompts()

    def weight(
        self,
        base: float,
        deepest_holders: Iterable[tuple[WorkerLoad, float]],
        held_blocks: Callable[[str], int],
        block_size: int,
        prompt_tokens: int,
        now: float,
    ) -> float:
        """``deepest_holders`` is (worker, predicted TTFT) per candidate holding the
        deepest match (none: no candidate holds any of the prompt), ``held_blocks`` the
        device blocks (of ``block_size`` tokens) a worker holds. The best chance among
        them counts: the rule would keep the request on that one. A chance is at most 1,
        so the first holder with a whole chance (one whose cache has evicted nothing
        lately) ends the search, and the holders are read no further: a popular prefix's
        20 holders each read their eviction rate otherwise, a quarter of a 100-worker
        decision."""
        if not base:
            return base
        chance = None
        for worker, ttft_s in deepest_holders:
            held = held_blocks(worker.worker_id)
            mine = self._chance(worker, ttft_s, held, block_size, prompt_tokens, now)
            chance = mine if chance is None else max(chance, mine)
            if chance >= 1.0:
                break
        return base if chance is None else base * chance

    def _chance(
        self,
        worker: WorkerLoad,
        ttft_s: float,
        held_blocks: int,
        block_size: int,
        prompt_tokens: int,
        now: float,
    ) -> float:
        """One holder's chance: kept through its wait, and room to run beside its
        running sequences (a cache that evicts nothing has both)."""
        worker_id = worker.worker_id
        retention = self.turnover.retention_s(worker_id, held_blocks, now)
        if math.isinf(retention):
            return 1.0
        kept = keep_chance(ttft_s, retention, self.pressure.margin)
        pinned = self.in_flight.pinned_tokens(worker_id, worker.in_flight_requests)
        return kept * room_chance(held_blocks * block_size, pinned, prompt_tokens)

    def routed(self, worker_id: str, prompt_tokens: int) -> None:
        """A request of ``prompt_tokens`` went to ``worker_id``."""
        self.in_flight.routed(worker_id, prompt_tokens)

    def observe(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        self.turnover.observe(worker_id, events)

    def forget(self, worker_id: str) -> None:
        self.turnover.forget(worker_id)
        self.in_flight.forget(worker_id)
