"""What ``--kv-storage mooncake://MASTER_HOST:PORT[?options]`` asks for.

Options (all optional): ``metadata`` (Mooncake's metadata server; default
``P2PHANDSHAKE``: peers are found through the master, no etcd), ``protocol`` (``tcp`` or
``rdma``), ``device`` (RDMA device names), ``host`` (this worker's address as peers
reach it; default 127.0.0.1 for a loopback master, else the host name), ``segment``
(bytes of this worker's memory lent to the store; default 0: segments are held by
``mooncake_client`` processes, so blocks outlive a worker's restart), ``buffer`` (the
client's transfer buffer, bytes), ``timeout`` (seconds a call may take; default 2) and
``retry`` (seconds the tier stays off after a fault; default 1). Sizes take a suffix
``K``, ``M``, ``G``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_OPTIONS = {"metadata", "protocol", "device", "host", "segment", "buffer", "timeout", "retry"}


@dataclass(frozen=True, slots=True)
class MooncakeStoreConfig:
    master: str  # host:port of mooncake_master
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device: str = ""
    host: str = "127.0.0.1"
    segment_bytes: int = 0
    buffer_bytes: int = 64 << 20
    timeout_s: float = 2.0
    retry_s: float = 1.0


def _size(name: str, text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    number, suffix = (text[:-1], text[-1]) if text[-1:] in _SUFFIX else (text, "")
    try:
        value = int(float(number) * _SUFFIX[suffix])
    except ValueError:
        raise ValueError(f"mooncake option {name}={text!r} is not a size") from None
    if value < 0:
        raise ValueError(f"mooncake option {name} must not be negative")
    return value


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"mooncake option {name}={text!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"mooncake option {name} must be positive")
    return value


def parse_mooncake_url(url: str) -> MooncakeStoreConfig:
    parts = urlsplit(url)
    if parts.scheme != "mooncake" or not parts.hostname or parts.port is None:
        raise ValueError(f"mooncake storage needs mooncake://MASTER_HOST:PORT, not {url!r}")
    options = dict(parse_qsl(parts.query, strict_parsing=bool(parts.query)))
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ValueError(f"unknown mooncake options {sorted(unknown)}: use {sorted(_OPTIONS)}")
    loopback = parts.hostname in {"127.0.0.1", "localhost", "::1"}
    default = MooncakeStoreConfig(master=f"{parts.hostname}:{parts.port}")
    return MooncakeStoreConfig(
        master=default.master,
        metadata=options.get("metadata", default.metadata),
        protocol=options.get("protocol", default.protocol),
        device=options.get("device", default.device),
        host=options.get("host", default.host if loopback else socket.gethostname()),
        segment_bytes=_size("segment", options.get("segment", str(default.segment_bytes))),
        buffer_bytes=_size("buffer", options.get("buffer", str(default.buffer_bytes))),
        timeout_s=_seconds("timeout", options.get("timeout", str(default.timeout_s))),
        retry_s=_seconds("retry", options.get("retry", str(default.retry_s))),
    )
