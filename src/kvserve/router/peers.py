"""Router replicas announcing their routing to each other over HTTP (``--peers``).

What is announced and how a peer applies it is :mod:`kvserve.core.routing.announcements`'s;
this module is the channel. Everything a replica notes during one turn of its event loop
(choices, undos, guard changes) goes out as one announcement, scheduled with
``call_soon`` when the first note of the turn comes: the others hear of a burst's choices
within one loop turn and one loopback round trip, not at a polling interval.

Workers are named by URL on the wire (each replica numbers its workers in the order it
registered them); a worker a peer does not know is left out of what it applies.

Each peer has its own sender task and outbox, so a slow or dead peer delays nobody else's
announcements, and routing never waits for any. The channel is a WebSocket per peer
(``GET /peers/stream`` on the peer), opened once: each message is a JSON list of every
announcement queued since the last one. A POST per batch cost the sender about 400 µs of
CPU per routed request on a loaded 2-core box, mostly the HTTP request itself
(docs/benchmarks.md, "Router replicas"); a message on an open stream costs a small part
of that. A broken stream (or a peer that refuses it) drops that peer's outbox, leaves it
alone for ``retry_s``, and the next stream starts with a full announcement (every load
this replica holds, replacing what the peer knew). Every
``full_every_s`` each peer gets a full announcement anyway: it is the heartbeat, and it
repairs whatever a lost batch left wrong. A peer heard from for ``peer_timeout_s`` no
longer counts: its announced load is dropped (it died, or restarted under a new origin).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

from kvserve.core.routing.announcements import Announcement, Announcer, LoadNote, PeerView

log = logging.getLogger(__name__)

ANNOUNCEMENTS_PATH = "/peers/announcements"  # one POST, for tools and tests
STREAM_PATH = "/peers/stream"  # the replicas' channel: a WebSocket, one per direction


@dataclass(slots=True)
class _Peer:
    url: str
    outbox: list[Announcement] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    needs_full: bool = True  # its view of this replica may be stale: send every load
    down_until: float = 0.0
    up: bool = False  # its last send went through
    sent: int = 0  # announcements written to its stream
    messages: int = 0  # stream messages (batches) written
    failures: int = 0


class PeerLink:
    """This replica's announcer, the peers' view, and the senders between them."""

    def __init__(
        self,
        peer_urls: tuple[str, ...],
        view: PeerView,
        headers: dict[str, str],
        worker_url: Callable[[str], str | None],
        worker_id: Callable[[str], str | None],
        clock: Callable[[], float] = time.monotonic,
        full_every_s: float = 1.0,
        peer_timeout_s: float = 5.0,
        retry_s: float = 1.0,
    ) -> None:
        # A new origin per process: a restarted replica's old load expires with it.
        self.announcer = Announcer(uuid.uuid4().hex[:12], on_note=self._schedule)
        self.view = view
        self._peers = [_Peer(url.rstrip("/")) for url in peer_urls]
        self._headers = headers
        self._worker_url = worker_url  # this router's worker id -> URL (None: gone)
        self._worker_id = worker_id  # URL -> this router's worker id (None: not ours)
        self._clock = clock
        self._full_every_s = full_every_s
        self._peer_timeout_s = peer_timeout_s
        self._retry_s = retry_s
        self._scheduled = False
        self._heard: dict[str, float] = {}  # origin -> when last heard
        self.received = 0

    def receive(self, body: bytes) -> int:
        """Apply a peer's ``POST`` body (a JSON list of announcements); returns how many.
        ValueError: the body is not that (nothing of it is applied)."""
        try:
            values = orjson.loads(body)
        except orjson.JSONDecodeError as error:
            raise ValueError(f"not JSON: {error}") from None
        if not isinstance(values, list):
            raise ValueError("expected a JSON list of announcements")
        announcements = [Announcement.from_json(value).renamed(self._worker_id) for value in values]
        now = self._clock()
        for announcement in announcements:
            if announcement.origin == self.announcer.origin:
                raise ValueError("an announcement from this replica itself: --peers lists it")
        for announcement in announcements:
            self.view.apply(announcement, now)
            self._heard[announcement.origin] = now
        self.received += len(announcements)
        return len(announcements)

    def describe(self) -> dict[str, object]:
        return {
            "origin": self.announcer.origin,
            "peers": [
                {
                    "url": p.url,
                    "up": p.up,
                    "sent": p.sent,
                    "messages": p.messages,
                    "failures": p.failures,
                }
                for p in self._peers
            ],
            "received": self.received,
            "heard_from": {o: round(self._clock() - at, 3) for o, at in self._heard.items()},
            "choices_recorded": self.view.choices_recorded,
        }

    async def run_forever(self, session: aiohttp.ClientSession) -> None:
        """The senders, the heartbeat and the expiry of silent peers, until cancelled."""
        tasks = [asyncio.create_task(self._send_forever(session, p)) for p in self._peers]
        try:
            while True:
                await asyncio.sleep(self._full_every_s)
                for peer in self._peers:
                    peer.needs_full = True
                    peer.ready.set()
                self._forget_silent()
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _schedule(self) -> None:
        """The first note of a loop turn: send what the turn noted once it is over."""
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside the server's loop (shutting down): the next turn sends
            return
        self._scheduled = True
        loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        announcement = self.announcer.take()
        if announcement.is_empty():
            return
        announcement = announcement.renamed(self._worker_url)
        now = self._clock()
        for peer in self._peers:
            if peer.down_until <= now:
                peer.outbox.append(announcement)
                peer.ready.set()

    async def _send_forever(self, session: aiohttp.ClientSession, peer: _Peer) -> None:
        """Keep a stream open to ``peer`` and write each batch to it; reconnect (after
        ``retry_s``, with a full announcement first) when it breaks."""
        timeout = aiohttp.ClientWSTimeout(ws_close=max(1.0, self._retry_s))
        while True:
            try:
                async with session.ws_connect(
                    peer.url + STREAM_PATH, headers=self._headers, timeout=timeout, autoping=True
                ) as stream:
                    peer.needs_full = True  # whatever it knew of this replica may be stale
                    await self._write_forever(stream, peer)
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as error:
                if peer.up or peer.failures == 0:
                    log.warning("peer %s unreachable (%s): skipped for now", peer.url, error)
                peer.up = False
                peer.failures += 1
                peer.outbox.clear()
                peer.down_until = self._clock() + self._retry_s
                await asyncio.sleep(self._retry_s)

    async def _write_forever(self, stream: aiohttp.ClientWebSocketResponse, peer: _Peer) -> None:
        while True:
            if peer.needs_full:
                peer.outbox.append(self._full())
                peer.needs_full = False
            if not peer.outbox:
                await peer.ready.wait()
                peer.ready.clear()
                continue
            if stream.closed:  # the peer closed it (it stopped, or refused what it got)
                raise aiohttp.ClientConnectionError(f"stream closed ({stream.close_code})")
            batch, peer.outbox = peer.outbox, []
            await stream.send_bytes(orjson.dumps([a.to_json() for a in batch]))
            peer.sent += len(batch)
            peer.messages += 1
            peer.up = True

    def _full(self) -> Announcement:
        loads = tuple(LoadNote(w, r, t) for w, (r, t) in self.announcer.held().items())
        full = Announcement(self.announcer.origin, loads=loads, full=True)
        return full.renamed(self._worker_url)

    def _forget_silent(self) -> None:
        horizon = self._clock() - self._peer_timeout_s
        for origin in [o for o, at in self._heard.items() if at < horizon]:
            self.view.forget_origin(origin)
            del self._heard[origin]
            log.warning(
                "peer router %s silent for %.0f s: its load dropped", origin, self._peer_timeout_s
            )
