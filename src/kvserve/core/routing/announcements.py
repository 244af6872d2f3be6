"""Router replicas announcing their routing to each other, so that each sees the fleet's
in-flight routing as one router would.

A replica sees its own guards exactly and nothing of the others': within a burst of
arrivals, replicas with the same index and loads make the same choice and pile the burst
onto the same workers (docs/benchmarks.md, "Routing at fleet scale"). Periodic load
reports come too late for a burst, and even exact loads leave each replica's prefill
queue and speculative index blind to the others' choices. So each replica announces:

- each choice: the worker and what the policy records of the prompt (kv_aware: its
  block hashes, tokens, and the tokens the choice predicted cached; cache_aware: its
  text), which a peer records as its own policy would have
  (``Policy.observe_peer_choice``: kv_aware queues the prefill and speculates the
  blocks there, cache_aware inserts the text in its tree);
- each undo of a choice (the attempt ended before its first token), which a peer takes
  back as the origin did;
- its guards' load on each worker whose load changed: absolute values (in-flight
  requests, prefill tokens), not deltas, so that a lost or repeated batch leaves no
  drift. A ``full`` announcement carries every worker the origin holds load on and
  replaces what the peer knew of it (after a peer was unreachable, or periodically).

A replica's view of a worker is then its own guards plus every peer's last announced
load (:meth:`PeerView.load`): one router's guards, late by the announcement delay.

What it cannot do: requests that reach different replicas within one announcement delay
of each other are decided blind to each other, and deterministic replicas in the same
state then choose alike (docs/benchmarks.md, "Router replicas announcing their routing").

The processes of one router (``kvserve router --processes N``) are replicas on one port
and exchange the same announcements (choices and undos) over socketpairs
(:mod:`kvserve.router.sibling_links`). They need no announced loads for their values:
their guards are summed exactly in a shared-memory table; a sibling's load notes only
tell a process which worker's total to re-read from it (kv_aware orders workers by load).

Pure and I/O-free: the simulator delivers announcements after a modelled delay, the
router over a WebSocket per peer (:mod:`kvserve.router.peers`) or a socketpair per
sibling process; all call :meth:`PeerView.apply`.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.core.routing.types import TakeBack

# A peer's choice is kept for its undo this long: past the speculation's lifetime and
# the end of the prefill it queued, a take-back changes nothing any more.
DEFAULT_UNDO_WINDOW_S = 30.0


@dataclass(frozen=True, slots=True)
class ChoiceNote:
    """One routing choice of the origin: ``seq`` numbers its choices (for the undo).

    What a policy records of a choice: kv_aware the prompt's block hashes, tokens and
    the tokens predicted cached; cache_aware the prompt's text in its pool and model's
    tree (``text`` is empty for the others). A prefill/decode pair is announced as two
    choices: the prefill worker's, and the decode worker's with ``computes`` False
    (kv_aware expects the blocks there, which the prefill worker sends, but queues no
    prefill). ``at`` is when the origin chose, on its clock: stamped only where the
    receivers share that clock (a router's processes on one host), so that they record
    the choice as of the same time as the origin (the speculative blocks' deadline, the
    prefill's end in the queue); peers on other hosts record it when it arrives."""

    seq: int
    worker_id: str
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    text: str = ""
    model: str = ""
    pool: str = "regular"
    computes: bool = True
    at: float | None = None


@dataclass(frozen=True, slots=True)
class LoadNote:
    """What the origin's own guards hold on ``worker_id`` now."""

    worker_id: str
    requests: int
    prefill_tokens: int


@dataclass(frozen=True, slots=True)
class Announcement:
    """What one replica tells its peers at once (one message of the channel)."""

    origin: str
    choices: tuple[ChoiceNote, ...] = ()
    undone: tuple[int, ...] = ()
    loads: tuple[LoadNote, ...] = ()
    full: bool = False  # ``loads`` is all the origin holds: replace, don't update

    def is_empty(self) -> bool:
        return not (self.choices or self.undone or self.loads or self.full)

    def renamed(self, name: Callable[[str], str | None]) -> Announcement:
        """The same with each worker id replaced by ``name(id)``; the notes of a worker
        named None are left out. Replicas may number the same workers differently (in
        the order each registered them): the router's channel names them by URL."""
        choices = []
        for c in self.choices:
            if (worker := name(c.worker_id)) is not None:
                choices.append(dataclasses.replace(c, worker_id=worker))
        loads = []
        for n in self.loads:
            if (worker := name(n.worker_id)) is not None:
                loads.append(dataclasses.replace(n, worker_id=worker))
        return dataclasses.replace(self, choices=tuple(choices), loads=tuple(loads))

    def to_json(self) -> dict[str, Any]:
        """The wire form: lists of plain values, small and quick to encode."""
        return {
            "origin": self.origin,
            "choices": [_choice_json(c) for c in self.choices],
            "undone": list(self.undone),
            "loads": [[n.worker_id, n.requests, n.prefill_tokens] for n in self.loads],
            "full": self.full,
        }

    @classmethod
    def from_json(cls, value: object) -> Announcement:
        """Parse :meth:`to_json`'s form; ValueError says what is wrong."""
        if not isinstance(value, Mapping) or not isinstance(value.get("origin"), str):
            raise ValueError('an announcement is an object with a string "origin"')
        try:
            choices = tuple(_parse_choice(choice) for choice in value.get("choices", ()))
            undone = tuple(_int(seq) for seq in value.get("undone", ()))
            loads = tuple(
                LoadNote(_str(worker), _nonnegative(r), _nonnegative(t))
                for worker, r, t in value.get("loads", ())
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"malformed announcement: {error}") from None
        return cls(value["origin"], choices, undone, loads, bool(value.get("full", False)))


def _choice_json(c: ChoiceNote) -> list[object]:
    fields: list[object] = [
        c.seq,
        c.worker_id,
        list(c.block_hashes),
        c.prompt_tokens,
        c.cached_tokens,
    ]
    if c.text or c.pool != "regular" or not c.computes or c.at is not None:
        fields += [c.text, c.model, c.pool, c.computes, c.at]
    return fields


def _parse_choice(value: object) -> ChoiceNote:
    if not isinstance(value, list) or len(value) not in (5, 10):
        raise ValueError(f"a choice is a list of 5 or 10 values, got {value!r:.80}")
    seq, worker, hashes, tokens, cached = value[:5]
    if not isinstance(hashes, list):
        raise ValueError("a choice's block hashes are a list")
    text, model, pool, computes, at = "", "", "regular", True, None
    if len(value) == 10:
        text, model, pool = (_str(v) for v in value[5:8])
        computes, at = value[8], value[9]
        if not isinstance(computes, bool):
            raise ValueError(f"a choice's computes flag is a boolean, got {computes!r}")
        if at is not None and (isinstance(at, bool) or not isinstance(at, int | float)):
            raise ValueError(f"a choice's time is a number, got {at!r}")
    return ChoiceNote(
        _int(seq),
        _str(worker),
        tuple(_int(h) for h in hashes),
        _int(tokens),
        _int(cached),
        text,
        model,
        pool,
        computes,
        None if at is None else float(at),
    )


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _nonnegative(value: object) -> int:
    number = _int(value)
    if number < 0:
        raise ValueError(f"a load is >= 0, got {number}")
    return number


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


class Announcer:
    """What this replica has to announce since the last :meth:`take`; ``on_note`` is
    called after each note (the router schedules a send). ``stamp_times``: the receivers
    share this replica's clock, so each choice carries its time (``ChoiceNote.at``)."""

    def __init__(
        self, origin: str, on_note: Callable[[], None] | None = None, stamp_times: bool = False
    ) -> None:
        self.origin = origin
        self.on_note = on_note
        self._stamp_times = stamp_times
        self._next_seq = 0
        self._choices: list[ChoiceNote] = []
        self._undone: list[int] = []
        self._changed: dict[str, None] = {}  # workers whose own load changed, in order
        self._loads: dict[str, tuple[int, int]] = {}  # own guards, nonzero only

    def choice(
        self,
        worker_id: str,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        cached_tokens: int,
        text: str = "",
        model: str = "",
        pool: str = "regular",
        computes: bool = True,
        at: float | None = None,
    ) -> int:
        """Record a choice made at ``at`` (kept only with ``stamp_times``); returns its
        number, for :meth:`undo`."""
        seq = self._next_seq
        self._next_seq += 1
        note = ChoiceNote(
            seq,
            worker_id,
            tuple(block_hashes),
            prompt_tokens,
            cached_tokens,
            text,
            model,
            pool,
            computes,
            at if self._stamp_times else None,
        )
        self._choices.append(note)
        self._noted()
        return seq

    def undo(self, seq: int) -> None:
        self._undone.append(seq)
        self._noted()

    def load(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        """This replica's guards on ``worker_id`` hold this now."""
        if requests or prefill_tokens:
            self._loads[worker_id] = (requests, prefill_tokens)
        else:
            self._loads.pop(worker_id, None)
        self._changed[worker_id] = None
        self._noted()

    def held(self) -> dict[str, tuple[int, int]]:
        """Every worker this replica's guards hold load on, and how much."""
        return dict(self._loads)

    def take(self, full: bool = False) -> Announcement:
        """Everything since the last take; ``full`` carries every held load instead of
        the changed ones only (for a peer that may have missed some)."""
        workers: Iterable[str] = self._loads if full else self._changed
        loads = tuple(LoadNote(w, *self._loads.get(w, (0, 0))) for w in workers)
        announcement = Announcement(
            self.origin, tuple(self._choices), tuple(self._undone), loads, full
        )
        self._choices, self._undone, self._changed = [], [], {}
        return announcement

    def _noted(self) -> None:
        if self.on_note is not None:
            self.on_note()


# Records a peer's choice in the policy's own state; returns what takes it back.
ChoiceRecorder = Callable[[ChoiceNote, float], TakeBack | None]


class PeerView:
    """What the peers announced: their load per worker, and their choices recorded in
    this replica's policy with what takes each back.

    ``on_load`` is told each worker whose peers' load changed, so the owner can tell its
    policy the combined load (kv_aware keeps workers ordered by load).
    """

    def __init__(
        self,
        record_choice: ChoiceRecorder,
        on_load: Callable[[str], None] | None = None,
        undo_window_s: float = DEFAULT_UNDO_WINDOW_S,
    ) -> None:
        self._record_choice = record_choice
        self._on_load = on_load
        self._undo_window_s = undo_window_s
        self._loads: dict[str, dict[str, tuple[int, int]]] = {}  # origin -> worker -> load
        self._totals: dict[str, tuple[int, int]] = {}  # worker -> summed over origins
        self._pending: OrderedDict[tuple[str, int], tuple[float, TakeBack]] = OrderedDict()
        self.applied = 0  # announcements applied
        self.choices_recorded = 0

    def load(self, worker_id: str) -> tuple[int, int]:
        """(in-flight requests, prefill tokens) the peers hold on ``worker_id``."""
        return self._totals.get(worker_id, (0, 0))

    def origins(self) -> list[str]:
        return list(self._loads)

    def apply(self, announcement: Announcement, now: float) -> None:
        """Record what a peer announced, in the order it was announced."""
        self.applied += 1
        origin = announcement.origin
        for note in announcement.choices:
            take_back = self._record_choice(note, now if note.at is None else note.at)
            self.choices_recorded += 1
            if take_back is not None:
                self._pending[(origin, note.seq)] = (now, take_back)
        for seq in announcement.undone:
            pending = self._pending.pop((origin, seq), None)
            if pending is not None:
                pending[1](now)
        known = self._loads.setdefault(origin, {})
        if announcement.full:
            listed = {n.worker_id for n in announcement.loads}
            for worker_id in [w for w in known if w not in listed]:
                self._set(origin, known, worker_id, 0, 0)
        for n in announcement.loads:
            self._set(origin, known, n.worker_id, n.requests, n.prefill_tokens)
        self._forget_old_choices(now)

    def forget_origin(self, origin: str) -> None:
        """A peer that left (or restarted): its load is no longer in flight here."""
        known = self._loads.get(origin)
        if known is not None:
            for worker_id in list(known):
                self._set(origin, known, worker_id, 0, 0)
            del self._loads[origin]

    def _set(
        self, origin: str, known: dict[str, tuple[int, int]], worker_id: str, r: int, t: int
    ) -> None:
        old_r, old_t = known.get(worker_id, (0, 0))
        if (old_r, old_t) == (r, t):
            return
        if r or t:
            known[worker_id] = (r, t)
        else:
            known.pop(worker_id, None)
        total_r, total_t = self._totals.get(worker_id, (0, 0))
        total = (total_r + r - old_r, total_t + t - old_t)
        if total == (0, 0):
            self._totals.pop(worker_id, None)
        else:
            self._totals[worker_id] = total
        if self._on_load is not None:
            self._on_load(worker_id)

    def _forget_old_choices(self, now: float) -> None:
        horizon = now - self._undo_window_s
        while self._pending:
            key, (at, _) = next(iter(self._pending.items()))
            if at >= horizon:
                return
            del self._pending[key]
