"""The name of the KV store a worker writes to, the same for every worker sharing it.

A worker's storage events announce only its own writes; the router credits them to
every worker reporting the same store (``storage_id`` in ``/kv/snapshot``), which can
load them too. Two workers must therefore get one name exactly when each can read the
other's blocks: the same store *and* the same block layout (the namespace keys are
written under, so workers of two models on one Redis are two stores).

The default name is the store's location: a file directory's real path on this
machine, a server's host, port and database. A loopback address or a local directory
is qualified by this machine's host name, since the same text on another machine is
another store. A directory shared over the network between machines, or a server
reached by different names, gets one name only from the operator
(``--kv-storage-id``). A wrong default only under-reports (a worker looks colder for a
block than it is) except where two machines' local names collide, which the host name
prevents.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

DEFAULT_PORTS = {"redis": 6379, "mooncake": 50051}


def store_identity(
    url: str, namespace: str, *, name: str | None = None, host: str | None = None
) -> str:
    """``url``'s store under ``namespace``: ``name`` (the operator's) or its location,
    then ``#namespace``. ``host`` is this machine's name (default: the host name)."""
    if name is None:
        name = _location(url, host if host is not None else socket.gethostname())
    return f"{name}#{namespace}"


def _location(url: str, host: str) -> str:
    scheme, _, rest = url.partition(":")
    if scheme == "file":
        return f"file://{host}{os.path.realpath(rest)}"
    parts = urlsplit(url)
    server = parts.hostname or "localhost"
    if _is_loopback(server):
        server = host
    port = parts.port or DEFAULT_PORTS.get(scheme, 0)
    database = "/" + (parts.path.strip("/") or "0") if scheme == "redis" else ""  # db 0
    return f"{scheme}://{server}:{port}{database}"


def _is_loopback(server: str) -> bool:
    if server == "localhost":
        return True
    try:
        return ipaddress.ip_address(server).is_loopback
    except ValueError:
        return False
