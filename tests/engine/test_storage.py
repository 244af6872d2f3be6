"""Storage backends (a real directory, a real redis-server) and the block value codec."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvserve.engine.kv_block_io import KVBlockLayout
from kvserve.engine.storage import KVStorage, StorageError, open_storage
from kvserve.engine.storage.block_codec import CorruptBlock, decode, encode, namespace_of
from kvserve.engine.storage.file_backend import FileStorage
from tests.support import redis_server as redis_support

redis_server = redis_support.redis_server

LAYOUT = KVBlockLayout("tiny", num_layers=2, block_size=4, num_kv_heads=1, head_dim=2,
                       dtype="float32")  # fmt: skip


def _block(seed: int) -> torch.Tensor:
    return (
        torch.arange(LAYOUT.block_nbytes // 4, dtype=torch.float32).reshape(1, *LAYOUT.block_shape)
        + seed
    )


@pytest.fixture(params=["file", "redis"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVStorage]:
    if request.param == "file":
        spec = f"file:{tmp_path / 'store'}"
    else:
        spec = request.getfixturevalue("redis_server").url
    backend = open_storage(spec, namespace_of(LAYOUT))
    yield backend
    backend.close()


def test_exists_is_the_longest_stored_prefix_and_batches_round_trip(storage: KVStorage) -> None:
    assert storage.exists([]) == 0
    assert storage.put_many([(1, b"one"), (2, b"two"), (4, b"four")]) == []
    assert storage.exists([1, 2, 3, 4]) == 2
    assert storage.exists([3, 1]) == 0
    assert storage.get_many([1, 3, 4]) == [b"one", None, b"four"]
    assert storage.get_many([2])[0] == b"two"
    storage.put_many([(3, b"three")])
    assert storage.exists([1, 2, 3, 4]) == 4
    storage.delete_many([2, 99])
    assert storage.exists([1, 2, 3]) == 1


def test_a_namespace_never_sees_another_layouts_keys(tmp_path: Path) -> None:
    other = KVBlockLayout("tiny", 2, 4, 1, 2, "bfloat16")
    assert namespace_of(other) != namespace_of(LAYOUT)
    mine = open_storage(f"file:{tmp_path}", namespace_of(LAYOUT))
    theirs = open_storage(f"file:{tmp_path}", namespace_of(other))
    mine.put_many([(7, b"x")])
    assert theirs.exists([7]) == 0 and mine.exists([7]) == 1


def test_file_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, "ns", max_bytes=1 << 20)
    storage.put_many([(key, bytes(100)) for key in range(20)])
    names = [path.name for path in (tmp_path / "ns").rglob("*") if path.is_file()]
    assert len(names) == 20 and not [name for name in names if name.endswith(".tmp")]


def test_file_size_is_bounded_and_eviction_takes_the_least_recently_used(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, "ns", max_bytes=1000)
    storage.put_many([(key, bytes(100)) for key in (1, 2, 3)])  # one chain
    os.utime(storage._path(1), (1, 1))  # an old prefix... (test-only peek at the layout)
    os.utime(storage._path(2), (2, 2))
    os.utime(storage._path(3), (3, 3))
    storage.get_many([1])  # ...used again now
    evicted = storage.put_many([(key, bytes(100)) for key in range(10, 18)])
    assert evicted == [2, 3]  # oldest first, the touched prefix stays
    assert storage.exists([1]) == 1 and storage.exists([2]) == 0
    total = sum(p.stat().st_size for p in (tmp_path / "ns").rglob("*.kvb"))
    assert total <= 1000


def test_file_writes_touch_a_chain_suffix_first(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, "ns", max_bytes=1 << 20)
    storage.put_many([(key, b"v") for key in (1, 2, 3)])
    times = [storage._path(key).stat().st_mtime_ns for key in (1, 2, 3)]
    assert times[0] >= times[1] >= times[2]


def test_a_failed_write_is_a_storage_error_and_leaves_nothing(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, "ns", max_bytes=1 << 20)
    (storage.directory / "00").write_bytes(b"")  # a file where the key's shard folder goes
    with pytest.raises(StorageError):
        storage.put_many([(0x00AB, b"value")])
    assert storage.exists([0x00AB]) == 0
    assert not list((tmp_path / "ns").rglob("*.tmp"))


def test_redis_down_is_a_storage_error(redis_server: redis_support.RedisServer) -> None:
    storage = open_storage(redis_server.url, "ns")
    storage.put_many([(1, b"x")])
    redis_server.kill()
    calls = (
        lambda: storage.exists([1]),
        lambda: storage.get_many([1]),
        lambda: storage.put_many([(2, b"y")]),
        lambda: storage.delete_many([1]),
    )
    for call in calls:
        with pytest.raises(StorageError):
            call()
    redis_server.start()  # empty again (no persistence), and the client reconnects
    assert storage.exists([1]) == 0
    storage.put_many([(1, b"x")])
    assert storage.get_many([1])[0] == b"x"


def test_unknown_storage_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="file:DIR"):
        open_storage("s3://bucket", "ns")
    with pytest.raises(ValueError, match="directory"):
        open_storage("file:", "ns")


def test_codec_round_trip_and_refusals() -> None:
    value = encode(LAYOUT, 42, _block(1))
    assert torch.equal(decode(LAYOUT, 42, value), _block(1))
    flipped = bytearray(value)
    flipped[-3] ^= 0xFF
    other_layout = KVBlockLayout("other", 2, 4, 1, 2, "float32")
    two_blocks = encode(LAYOUT, 42, torch.cat([_block(1), _block(2)]))
    bad = {
        "truncated": value[:-10],
        "short": value[:5],
        "flipped": bytes(flipped),
        "foreign layout": encode(other_layout, 42, _block(1)),
        "two blocks": two_blocks,
    }
    for name, data in bad.items():
        with pytest.raises(CorruptBlock):
            decode(LAYOUT, 42, data)
            pytest.fail(name)
    with pytest.raises(CorruptBlock, match="does not frame"):
        decode(LAYOUT, 43, value)
