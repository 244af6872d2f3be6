"""A ZMQ link between a KV event publisher and the router that loses messages on demand:
the gap a slow subscriber or a full queue would cause, made to happen at a chosen moment.
It forwards every message unchanged (a SUB upstream, an XPUB downstream) from a thread;
the router asks the publisher's own replay socket for what was lost. It also notes the
last sequence number it forwarded and how many blocks the forwarded steps removed, so a
test knows when the router has seen an eviction."""

from __future__ import annotations

import threading

import zmq

from kvserve.core.vllm_kv_wire import BlockRemoved, decode_batch, decode_seq
from kvserve.router.ports import free_port


class LossyZmqLink:
    def __init__(self, upstream: str) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.forwarded = 0
        self.dropped = 0
        self.subscribers = 0
        self.last_seq = -1
        self.removed_blocks = 0
        self._to_drop = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._upstream = upstream
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def drop_next(self, count: int = 1) -> None:
        with self._lock:
            self._to_drop += count

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self._upstream)
        pub = self._context.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(pub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for socket, _ in poller.poll(50):
                    if socket is pub:
                        if pub.recv()[:1] == b"\x01":
                            self.subscribers += 1
                        continue
                    frames = sub.recv_multipart()
                    with self._lock:
                        drop = self._to_drop > 0
                        self._to_drop -= drop
                    if drop:
                        self.dropped += 1
                    else:
                        pub.send_multipart(frames)
                        self._note(frames)
                        self.forwarded += 1
        finally:
            sub.close()
            pub.close()

    def _note(self, frames: list[bytes]) -> None:
        events = decode_batch(frames[2]).events
        self.removed_blocks += sum(
            len(e.block_hashes) for e in events if isinstance(e, BlockRemoved)
        )
        self.last_seq = decode_seq(frames[1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._context.term()
