"""Workers get one store name exactly when each can read the other's stored blocks."""

from __future__ import annotations

from pathlib import Path

from kvserve.engine.storage.identity import store_identity


def test_one_directory_reached_by_two_paths_is_one_store(tmp_path: Path) -> None:
    (tmp_path / "kv").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "kv")
    first = store_identity(f"file:{tmp_path / 'kv'}", "ns", host="m1")
    assert first == store_identity(f"file:{tmp_path / 'link'}/", "ns", host="m1")
    assert first == f"file://m1{(tmp_path / 'kv').resolve()}#ns"
    # the same path on another machine is another directory
    assert first != store_identity(f"file:{tmp_path / 'kv'}", "ns", host="m2")


def test_a_servers_name_holds_its_address_and_database_not_its_options() -> None:
    def name(url: str, host: str = "m1") -> str:
        return store_identity(url, "ns", host=host)

    assert name("redis://cache.internal") == "redis://cache.internal:6379/0#ns"
    assert name("redis://cache.internal:6379/0") == name("redis://cache.internal")
    assert name("redis://cache.internal/1") != name("redis://cache.internal")
    assert name("mooncake://master:50051?segment=1GiB&timeout=3") == "mooncake://master:50051#ns"
    # a loopback server is this machine's
    assert (
        name("redis://127.0.0.1:7000") == name("redis://localhost:7000") == ("redis://m1:7000/0#ns")
    )
    assert name("redis://127.0.0.1:7000") != name("redis://127.0.0.1:7000", host="m2")


def test_layouts_and_the_operators_name_keep_stores_apart() -> None:
    assert store_identity("redis://r", "llama-fp32", host="m") != store_identity(
        "redis://r", "llama-bf16", host="m"
    )
    named = store_identity("file:/mnt/nfs/kv", "ns", name="team-nfs", host="m1")
    assert named == "team-nfs#ns" == store_identity("file:/x", "ns", name="team-nfs", host="m2")
