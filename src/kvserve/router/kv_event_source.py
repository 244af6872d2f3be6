"""Where the router reads one worker's KV events: ``--kv-events`` and ``POST /workers``.

``kvserve`` (the default) is the worker's own HTTP stream (``/kv/events``, ``/kv/snapshot``).
``tcp://host:port`` or ``ipc://path`` is a ZMQ publisher in vLLM's format (vLLM, SGLang,
or a kvserve worker's ``--kv-events-publisher``); ``?replay=ENDPOINT`` names its replay
socket, through which a gap in the sequence is filled instead of dropping the worker's
index.
"""

from __future__ import annotations

from dataclasses import dataclass

KVSERVE_STREAM = "kvserve"
_ZMQ_SCHEMES = ("tcp://", "ipc://")


@dataclass(frozen=True, slots=True)
class ZmqEventSource:
    endpoint: str
    replay: str | None = None

    def describe(self) -> str:
        return self.endpoint + (f"?replay={self.replay}" if self.replay else "")


KVEventSource = ZmqEventSource | None  # None: the worker's HTTP stream


def _zmq_endpoint(value: str) -> str:
    if not value.startswith(_ZMQ_SCHEMES) or len(value) <= len("tcp://"):
        raise ValueError(f"KV event endpoint {value!r}: expected tcp://host:port or ipc://path")
    if value.startswith("tcp://"):
        host, _, port = value[len("tcp://") :].rpartition(":")
        if not host or "*" in host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"KV event endpoint {value!r}: the router connects, name host:port")
    return value


def parse_kv_event_source(value: str) -> KVEventSource:
    """``kvserve``, or ``ENDPOINT[?replay=ENDPOINT]``; ValueError otherwise."""
    if value == KVSERVE_STREAM:
        return None
    endpoint, _, query = value.partition("?")
    replay = None
    if query:
        key, _, replay_value = query.partition("=")
        if key != "replay":
            raise ValueError(f"KV event endpoint {value!r}: the only option is ?replay=")
        replay = _zmq_endpoint(replay_value)
    return ZmqEventSource(_zmq_endpoint(endpoint), replay)


def describe(source: KVEventSource) -> str:
    return KVSERVE_STREAM if source is None else source.describe()
