"""The storage tier on a real Mooncake Store (master + segment holder on loopback ports):
its status codes mapped to the tier's meaning, a master killed and restarted, a full
segment. The engine keeps answering with the cold engine's tokens throughout."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

from kvserve.engine.storage import StorageError, open_storage
from kvserve.engine.storage.mooncake_url import parse_mooncake_url
from tests.engine.test_tier_faults import PROMPTS, _engine, _fault_logs, _serve_fresh, expected
from tests.engine.test_tiers import generate, tiers_of
from tests.support import mooncake_master as mooncake_support

mooncake_store = mooncake_support.mooncake_store
__all__ = ["expected"]  # the cold engine's tokens, a fixture


def test_codes_mean_hit_miss_or_fault(mooncake_store: mooncake_support.MooncakeStore) -> None:
    writer = open_storage(mooncake_store.url, "ns")
    reader = open_storage(mooncake_store.url, "ns")  # a second client: another worker
    other = open_storage(mooncake_store.url, "other-layout")
    try:
        assert writer.put_many([(1, b"one" * 40), (2, b"two" * 40)]) == []
        assert writer.put_many([(1, b"one" * 40)]) == []  # stored already: not a fault
        assert reader.exists([1, 2, 3]) == 2 and reader.exists([3, 1]) == 0
        assert reader.get_many([1, 3, 2]) == [b"one" * 40, None, b"two" * 40]
        assert other.exists([1]) == 0  # namespaces keep layouts apart
        reader.delete_many([1, 3])  # just read (leased), and one missing: both fine
        assert writer.exists([1, 2]) == 0 and writer.exists([2]) == 1
        mooncake_store.kill_master()
        with pytest.raises(StorageError):  # a dead master is a fault, not a miss
            reader.exists([2])
        started = time.monotonic()
        with pytest.raises(StorageError):  # and the next call does not wait for it
            reader.get_many([2])
        assert time.monotonic() - started < 0.5
    finally:
        for storage in (writer, reader, other):
            storage.close()


def test_url_options_are_parsed_and_checked() -> None:
    config = parse_mooncake_url("mooncake://127.0.0.1:5000?segment=1G&timeout=0.5&protocol=rdma")
    assert (config.master, config.segment_bytes) == ("127.0.0.1:5000", 1 << 30)
    assert config.timeout_s == 0.5
    assert (config.protocol, config.metadata, config.host) == ("rdma", "P2PHANDSHAKE", "127.0.0.1")
    for bad in ("mooncake://host", "mooncake://h:1?size=3", "mooncake://h:1?timeout=0"):
        with pytest.raises(ValueError):
            parse_mooncake_url(bad)


def test_master_killed_mid_run_then_restarted(
    tiny_model_dir: Path,
    expected: list[list[int]],
    mooncake_store: mooncake_support.MooncakeStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "kvserve.engine.kv_offload")
    url = f"{mooncake_store.url}?timeout=1&retry=0.2"
    engine = _engine(tiny_model_dir, url)
    assert generate(engine, {"a": PROMPTS[0]})["a"][0] == expected[0]
    mooncake_store.kill_master()
    for index in (1, 2):  # the device cache is dropped: only the dead store could help
        engine.kv_cache.clear()
        assert generate(engine, {f"down{index}": PROMPTS[index]})[f"down{index}"] == (
            expected[index], 0,
        )  # fmt: skip
    faults = tiers_of(engine).metrics()
    assert faults["fault_read"] >= 2 and _fault_logs(caplog, "read") == 1
    mooncake_store.start_master()  # back, empty: the segment holder mounts again
    engine.kv_cache.clear()
    assert generate(engine, {"up": PROMPTS[0]})["up"] == (expected[0], 0)
    deadline = time.monotonic() + 30
    while True:  # a fresh engine writes, the next loads, once the segment is back
        tokens, cached, _ = _serve_fresh(tiny_model_dir, url, 1)
        assert tokens == expected[1]
        if cached == 192:
            break
        assert time.monotonic() < deadline, "the store did not serve again after a restart"
    engine.check()
    engine.close()


def test_a_full_segment_refuses_puts_and_requests_are_recomputed(
    tiny_model_dir: Path,
    expected: list[list[int]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "kvserve.engine.kv_offload")
    store = mooncake_support.start_store(tmp_path / "small", segment_bytes=16 << 20)
    filler = MooncakeDistributedStore()
    try:
        master = f"127.0.0.1:{store.port}"
        assert filler.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
        pinned = ReplicateConfig()
        pinned.with_hard_pin = True  # never evicted: the segment stays full
        codes = [filler.put_batch([f"fill{i}"], [bytes(1 << 20)], pinned) for i in range(20)]
        assert codes.count(0) >= 10 and codes[-1] == -200  # full
        engine = _engine(tiny_model_dir, store.url)
        for index in (0, 1):
            assert (
                generate(engine, {f"r{index}": PROMPTS[index]})[f"r{index}"][0] == (expected[index])
            )
        engine.close()
        metrics = tiers_of(engine).metrics()
        assert metrics["fault_write"] >= 1 and metrics["storage_failed_blocks"] >= 12
        assert _fault_logs(caplog, "write") == 1
        assert _serve_fresh(tiny_model_dir, store.url, 2)[:2] == (expected[2], 0)
    finally:
        filler.close()
        store.kill()


def test_a_store_whose_holder_exits_is_tried_twice_then_fails_with_both_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment under Mooncake's 16 MiB makes the holder exit at once: started again on
    fresh ports, it exits again, and the failure carries both attempts, each master
    killed (nothing of either left running)."""
    started: list[mooncake_support.MooncakeStore] = []
    start_master = mooncake_support.MooncakeStore.start_master

    def recorded(store: mooncake_support.MooncakeStore) -> mooncake_support.MooncakeStore:
        started.append(store)
        return start_master(store)

    monkeypatch.setattr(mooncake_support.MooncakeStore, "start_master", recorded)
    with pytest.raises(RuntimeError) as failure:
        mooncake_support.start_store(tmp_path / "tiny", segment_bytes=1)
    message = str(failure.value)
    assert message.count("Total size must be at least") >= 2
    assert "(and the attempt before:" in message
    assert len(started) == 2
    for store in started:
        for program in (store.master, store.holder):
            assert program.process is not None and program.process.poll() is not None
