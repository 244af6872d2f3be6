"""Storage faults: the engine keeps serving the right tokens by recomputing, logs each
kind of fault once, counts every one, and its ledger stays consistent."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.engine.kv_tier_config import KVTierConfig
from kvserve.engine.kv_tiers.connector import kv_tiers
from kvserve.engine.llm_engine import LLMEngine
from tests.engine.test_tiers import PREFIX, generate, tiers_of
from tests.support import redis_server as redis_support

redis_server = redis_support.redis_server

PROMPTS = [[*PREFIX, 41, 42], [*PREFIX, 51], [*PREFIX, 61, 62, 63]]


@pytest.fixture
def expected(tiny_model_dir: Path) -> list[list[int]]:
    cold = LLMEngine(tiny_model_dir, num_blocks=128, device="cpu")
    return [generate(cold, {f"c{i}": p})[f"c{i}"][0] for i, p in enumerate(PROMPTS)]


def _engine(model_dir: Path, storage: str) -> LLMEngine:
    config = KVTierConfig(storage=storage)
    return LLMEngine(model_dir, num_blocks=64, device="cpu", connectors=[kv_tiers(config)])


def _serve_fresh(model_dir: Path, storage: str, index: int) -> tuple[list[int], int, dict]:
    """Prompt ``index`` on a new engine (empty device cache) over ``storage``."""
    engine = _engine(model_dir, storage)
    try:
        tokens, cached = generate(engine, {"r": PROMPTS[index]})["r"]
        engine.check()
        return tokens, cached, tiers_of(engine).metrics()
    finally:
        engine.close()


def _fault_logs(caplog: pytest.LogCaptureFixture, kind: str) -> int:
    return sum(f"KV storage {kind} fault" in r.getMessage() for r in caplog.records)


def test_redis_killed_mid_run_and_restarted(
    tiny_model_dir: Path,
    expected: list[list[int]],
    redis_server: redis_support.RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "kvserve.engine.kv_offload")
    engine = _engine(tiny_model_dir, redis_server.url)
    assert generate(engine, {"a": PROMPTS[0]})["a"][0] == expected[0]
    redis_server.kill()
    for index in (1, 2):  # the device cache is dropped: only the dead store could help
        engine.kv_cache.clear()
        assert generate(engine, {f"down{index}": PROMPTS[index]})[f"down{index}"] == (
            expected[index], 0,
        )  # fmt: skip
    faults = tiers_of(engine).metrics()
    assert faults["fault_read"] >= 2 and _fault_logs(caplog, "read") == 1
    redis_server.start()  # back, empty: writes resume, then a fresh engine loads
    engine.kv_cache.clear()
    assert generate(engine, {"up": PROMPTS[0]})["up"] == (expected[0], 0)
    engine.check()
    engine.close()
    assert _serve_fresh(tiny_model_dir, redis_server.url, 1)[:2] == (expected[1], 192)


def _block_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kvb"), key=lambda p: p.stat().st_mtime_ns, reverse=True)


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_file_is_a_miss_from_that_block_on(
    tiny_model_dir: Path,
    expected: list[list[int]],
    tmp_path: Path,
    damage: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "kvserve.engine.kv_offload")
    spec = f"file:{tmp_path / 'kv'}"
    _serve_fresh(tiny_model_dir, spec, 0)
    files = _block_files(tmp_path / "kv")  # newest first: the chain's root is touched last
    assert len(files) == 12
    victim = files[5]  # block 5 of the prefix
    data = bytearray(victim.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0x5A
        victim.write_bytes(bytes(data))
    else:
        victim.write_bytes(bytes(data[: len(data) // 3]))
    tokens, cached, metrics = _serve_fresh(tiny_model_dir, spec, 1)
    assert (tokens, cached) == (expected[1], 5 * 16)  # blocks 0-4 loaded, the rest computed
    assert metrics["fault_corrupt"] == 1 and _fault_logs(caplog, "corrupt") == 1
    # The bad value was removed and rewritten from the recomputed block: a third engine
    # loads the whole prefix again.
    assert _serve_fresh(tiny_model_dir, spec, 2)[:2] == (expected[2], 192)


@pytest.fixture
def full_directory(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, already full (mounting needs root: skipped without it)."""
    mount_point = tmp_path / "full"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with (mount_point / "filler").open("wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(bytes(4096))
            except OSError:
                pass  # full
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_fails_writes_not_requests(
    tiny_model_dir: Path,
    expected: list[list[int]],
    full_directory: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "kvserve.engine.kv_offload")
    spec = f"file:{full_directory}"
    engine = _engine(tiny_model_dir, spec)
    for index in (0, 1):
        assert generate(engine, {f"r{index}": PROMPTS[index]})[f"r{index}"][0] == expected[index]
    engine.close()
    metrics = tiers_of(engine).metrics()
    assert metrics["fault_write"] >= 1 and metrics["storage_failed_blocks"] >= 12
    assert _fault_logs(caplog, "write") == 1
    assert not list(full_directory.rglob("*.tmp"))
