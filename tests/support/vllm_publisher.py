"""A KV event publisher that speaks vLLM's ZMQ format, written from the format alone
(not from kvserve's encoder), for driving the router's follower from a test.

Frames: topic, 8-byte big-endian seq, msgpack ``[ts, [event maps], rank]``. The replay
socket (ROUTER) answers ``[b"", start_seq]`` with every buffered step from it on, then
``[b"", b"", 0xFF * 8, b""]``, served from a thread. The data socket is an XPUB, which a
SUB cannot tell from vLLM's PUB, so that a test can wait for the subscription to arrive
instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import zmq

END = b"\xff" * 8


def block_stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
    medium: str = "GPU",
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
    }
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    return event


def block_removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


class VllmFormatPublisher:
    """Binds ``tcp://127.0.0.1:port`` (and a replay port when given)."""

    def __init__(self, port: int, replay_port: int | None = None, topic: str = "kv") -> None:
        self.context = zmq.Context()
        self.port, self.replay_port = port, replay_port
        self.topic = topic.encode()
        self.buffer: list[tuple[int, bytes]] = []
        self.next_seq = 0
        self.pub = self._bind(zmq.XPUB, port)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not the first
        self.replays_served = 0
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_port is not None:
            replay = self._bind(zmq.ROUTER, replay_port)
            self._replay_thread = threading.Thread(target=self._serve, args=(replay,), daemon=True)
            self._replay_thread.start()

    def _bind(self, kind: int, port: int) -> zmq.Socket[bytes]:
        """Bind, retrying while the port of a just-closed publisher is still held."""
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.bind(f"tcp://127.0.0.1:{port}")
                return socket
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wait_for_subscriber(self, timeout_s: float = 10.0, count: int = 1) -> None:
        """Block until ``count`` SUBs' subscriptions arrive (XPUB delivers each as a
        message): a router of several processes subscribes once per process."""
        deadline = time.monotonic() + timeout_s
        for _ in range(count):
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not self.pub.poll(left_ms):
                raise TimeoutError("no subscriber connected")
            assert self.pub.recv()[:1] == b"\x01"

    def publish(self, events: list[dict[str, Any]], *, send: bool = True) -> int:
        """One step's batch under the next seq; ``send=False`` buffers it for the replay
        only (a message the subscriber missed)."""
        seq = self.next_seq
        self.next_seq += 1
        payload = msgpack.packb([time.time(), events, 0])
        self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve(self, replay: zmq.Socket[bytes]) -> None:
        while not self._stop.is_set():
            if not replay.poll(50):
                continue
            client, _, start = replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    seq_frame = seq.to_bytes(8, "big")
                    replay.send_multipart([client, b"", self.topic, seq_frame, payload])
            replay.send_multipart([client, b"", b"", END, b""])
            self.replays_served += 1
        replay.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join()
        self.pub.close(linger=0)
        self.context.term()
