"""``--kv-events`` values: the worker's HTTP stream, or a ZMQ publisher with an optional
replay socket, one per worker URL and in the same order."""

from __future__ import annotations

import pytest

from kvserve.router.config import RouterConfig
from kvserve.router.kv_event_source import ZmqEventSource, parse_kv_event_source


def test_sources_parse() -> None:
    assert parse_kv_event_source("kvserve") is None
    assert parse_kv_event_source("tcp://h:1") == ZmqEventSource("tcp://h:1")
    assert parse_kv_event_source("ipc:///tmp/kv?replay=tcp://h:2") == ZmqEventSource(
        "ipc:///tmp/kv", "tcp://h:2"
    )
    bad_values = ("", "http://h:1", "tcp://h", "tcp://*:1", "tcp://h:x", "tcp://h:0", "tcp://:5")
    for bad in (*bad_values, "tcp://h:1?replay=", "tcp://h:1?x=y"):
        with pytest.raises(ValueError):
            parse_kv_event_source(bad)


def test_one_source_per_worker_in_order() -> None:
    urls = ("http://a:1", "http://b:1")
    config = RouterConfig(worker_urls=urls, kv_events=("tcp://a:5", "kvserve"))
    assert config.kv_event_sources() == (ZmqEventSource("tcp://a:5"), None)
    assert RouterConfig(worker_urls=urls).kv_event_sources() == (None, None)
    with pytest.raises(ValueError, match="one per worker"):
        RouterConfig(worker_urls=urls, kv_events=("tcp://a:5",))
    with pytest.raises(ValueError):
        RouterConfig(worker_urls=urls[:1], kv_events=("udp://a:5",))
    with pytest.raises(ValueError):
        RouterConfig(worker_urls=urls[:1], kv_block_size=0)
