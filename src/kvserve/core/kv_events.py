"""KV events: the ordered record of what a worker's cache holds (docs/architecture.md,
"Life of a KV block").

The router's exact cache index is rebuilt from these events alone, so every change of
what is held emits one, in order, with no gaps in the sequence numbers. A subscriber
that reads too slowly would otherwise make the log grow without bound; instead the log
keeps a bounded history, and ``since`` tells a subscriber that fell behind (or that
talks to a restarted log) to resynchronise from a snapshot by raising
:class:`EventGapError`, never by silently skipping events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Literal

EventKind = Literal["stored", "removed", "cleared"]
EVENT_KINDS: frozenset[str] = frozenset(("stored", "removed", "cleared"))
DEFAULT_HISTORY = 10_000
_MISSING = object()


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One change of what a tier holds.

    ``stored``: ``block_hashes`` is a chain, parent first, and ``parent_hash`` is the hash
    of the block before the first one (``None`` when the chain starts at the root).
    ``removed``: the hashes dropped, in any order. ``cleared``: the tier now holds nothing.
    ``token_ids``: a ``stored`` chain's tokens (``block_size`` per block) when the writer
    knew them, else empty. Only the vLLM-format publisher reads them: a foreign router
    keys blocks by its own hash of the tokens, not by ours.
    """

    seq: int
    kind: EventKind
    tier: str
    block_hashes: tuple[int, ...]
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class EventGapError(Exception):
    """The events a subscriber asked for are no longer (or not yet) in the log.

    The subscriber's view can no longer be brought up to date incrementally: it must
    take a snapshot (``KVCacheManager.snapshot()``) and continue from its sequence number.
    """


class EventLog:
    """Sequence-numbered events with a bounded history.

    ``record_tokens``: keep the token ids writers give with ``stored`` events. Off by
    default: only a vLLM-format publisher reads them, and a history of long prompts'
    tokens would cost memory every other log (the simulator's many) does not need."""

    __slots__ = ("_history", "last_seq", "record_tokens")

    def __init__(self, max_history: int = DEFAULT_HISTORY, record_tokens: bool = False) -> None:
        if max_history <= 0:
            raise ValueError(f"max_history must be positive, got {max_history}")
        self._history: deque[KVEvent] = deque(maxlen=max_history)
        self.last_seq = 0
        self.record_tokens = record_tokens

    def append(
        self,
        kind: EventKind,
        tier: str,
        block_hashes: Sequence[int],
        parent_hash: int | None = None,
        token_ids: Sequence[int] = (),
    ) -> KVEvent:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown KV event kind {kind!r}")
        self.last_seq += 1
        tokens = tuple(token_ids) if self.record_tokens else ()
        event = KVEvent(self.last_seq, kind, tier, tuple(block_hashes), parent_hash, tokens)
        self._history.append(event)
        return event

    def since(self, seq: int) -> list[KVEvent]:
        """Events with sequence number greater than ``seq``, oldest first.

        Raises :class:`EventGapError` if some of them were dropped from the bounded
        history, or if ``seq`` is ahead of this log (the log was restarted).
        """
        if seq > self.last_seq:
            raise EventGapError(f"seq {seq} is ahead of this log (last seq {self.last_seq})")
        if seq == self.last_seq:
            return []
        oldest = self.last_seq - len(self._history) + 1
        if seq + 1 < oldest:
            raise EventGapError(
                f"events {seq + 1}..{oldest - 1} were dropped from the history; resync "
                "from a snapshot"
            )
        # from the newest end: a reader asks for the few events since its last read, and
        # an islice from the oldest stepped over the whole history (10,000 events, ~70 µs
        # a call on the engine thread; 15% of a simulation's run)
        events = list(islice(reversed(self._history), self.last_seq - seq))
        events.reverse()
        return events


def apply_events(view: dict[int, int | None], events: Iterable[KVEvent]) -> None:
    """Bring a subscriber's view of one tier (``hash -> parent hash``) up to date.

    Start from a snapshot's blocks (``dict(blocks)``) and apply the events after its
    sequence number, in order. An event that does not fit the view (a chain stored under
    a parent it lacks, a removal of a block it lacks) means the view missed something:
    :class:`EventGapError`, and the view must be rebuilt from a snapshot.
    """
    for event in events:
        if event.kind == "stored":
            parent = event.parent_hash
            if parent is not None and parent not in view:
                raise EventGapError(f"event {event.seq} stores under unknown {parent:#x}")
            for block_hash in event.block_hashes:
                view[block_hash] = parent
                parent = block_hash
        elif event.kind == "removed":
            for block_hash in event.block_hashes:
                if view.pop(block_hash, _MISSING) is _MISSING:
                    raise EventGapError(f"event {event.seq} removes unknown {block_hash:#x}")
        else:
            view.clear()
