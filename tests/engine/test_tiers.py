"""The engine's KV tiers: host hits after device eviction, a store shared by two
engines, preemption resumed from storage, write policies. Every test ends with the
ledger's and the host index's checks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from kvserve.core.request import RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.kv_tier_config import KVTierConfig
from kvserve.engine.kv_tiers.connector import KVTiers, kv_tiers
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.storage import KVStorage, register_backend
from kvserve.engine.storage.base import is_storage_url, storage_usage
from tests.support import mooncake_master as mooncake_support
from tests.support import redis_server as redis_support

redis_server = redis_support.redis_server
mooncake_store = mooncake_support.mooncake_store

PREFIX = [(7 * i) % 900 + 5 for i in range(192)]  # 12 full blocks of 16


def _params(max_tokens: int = 6, cache_salt: str | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, cache_salt=cache_salt
    )


def generate(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int = 6,
             cache_salt: str | None = None) -> dict[str, tuple[list[int], int]]:  # fmt: skip
    """Greedy outputs and cached prompt tokens per request id, all run together."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, _params(max_tokens, cache_salt))
    results: dict[str, tuple[list[int], int]] = {rid: ([], 0) for rid in prompts}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens, _ = results[output.request_id]
            results[output.request_id] = (tokens + output.new_token_ids, output.num_cached_tokens)
        engine.check()
    return results


@pytest.fixture
def cold(tiny_model_dir: Path) -> LLMEngine:
    """The reference: no tiers, a pool large enough for anything here."""
    return LLMEngine(tiny_model_dir, num_blocks=128, device="cpu")


@pytest.fixture
def engines(tiny_model_dir: Path) -> Iterator[list[LLMEngine]]:
    """Engines a test makes (``make``) and whose tier threads are stopped after it."""
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.check()
        engine.close()


def tiers_of(engine: LLMEngine) -> KVTiers:
    return engine.connector(KVTiers)


def make(engines: list[LLMEngine], model_dir: Path, config: KVTierConfig,
         num_blocks: int = 64) -> LLMEngine:  # fmt: skip
    engine = LLMEngine(
        model_dir, num_blocks=num_blocks, device="cpu", connectors=[kv_tiers(config)]
    )
    engines.append(engine)
    return engine


def test_host_tier_hit_after_device_eviction(
    tiny_model_dir: Path, cold: LLMEngine, engines: list[LLMEngine]
) -> None:
    prompt = [*PREFIX, 11, 12, 13]
    [(expected, _)] = generate(cold, {"c": prompt}).values()
    engine = make(engines, tiny_model_dir, KVTierConfig(host_blocks=64))
    assert generate(engine, {"a": prompt})["a"] == (expected, 0)
    engine.kv_cache.clear()  # the device forgets everything
    assert generate(engine, {"b": prompt})["b"] == (expected, 192)
    assert tiers_of(engine).stats.host_hit_tokens == 192
    host_events = [e for e in engine.events.since(0) if e.tier == "host"]
    assert host_events and host_events[0].kind == "stored"


def test_the_host_tier_keeps_salted_blocks_apart(
    tiny_model_dir: Path, engines: list[LLMEngine]
) -> None:
    engine = make(engines, tiny_model_dir, KVTierConfig(host_blocks=64))
    prompt = [*PREFIX, 11, 12, 13]
    assert generate(engine, {"a": prompt}, cache_salt="A")["a"][1] == 0
    engine.kv_cache.clear()  # what follows can only come from the host tier
    assert generate(engine, {"b": prompt}, cache_salt="B")["b"][1] == 0
    assert generate(engine, {"u": prompt})["u"][1] == 0
    engine.kv_cache.clear()
    assert generate(engine, {"c": prompt}, cache_salt="A")["c"][1] == 192


def test_host_tier_bounded_by_memory(tiny_model_dir: Path, engines: list[LLMEngine]) -> None:
    engine = make(engines, tiny_model_dir, KVTierConfig(host_memory=5 * 16384))  # 5 blocks
    generate(engine, {"a": [*PREFIX, 1]})
    assert tiers_of(engine).metrics()["host_blocks"] == 5


@pytest.fixture(params=["file", "redis", "mooncake"])
def storage_spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file:{tmp_path / 'kv'}"
    if request.param == "mooncake":
        return str(request.getfixturevalue("mooncake_store").url)
    return str(request.getfixturevalue("redis_server").url)


def test_a_second_engine_sharing_the_store_loads_the_prefix(
    tiny_model_dir: Path, cold: LLMEngine, engines: list[LLMEngine], storage_spec: str
) -> None:
    first, second = [*PREFIX, 21, 22, 23, 24], [*PREFIX, 31, 32]
    expected = generate(cold, {"c": second})["c"][0]
    writer = make(engines, tiny_model_dir, KVTierConfig(storage=storage_spec))
    generate(writer, {"a": first})
    writer.close()  # flush its queued writes
    reader = make(engines, tiny_model_dir, KVTierConfig(storage=storage_spec))
    assert generate(reader, {"b": second})["b"] == (expected, 192)
    assert tiers_of(reader).stats.storage_hit_tokens == 192
    writer.step()  # announces the writes that completed
    stored = [e for e in writer.events.since(0) if e.tier == "storage" and e.kind == "stored"]
    assert sum(len(e.block_hashes) for e in stored) == 12


def test_a_shared_store_keeps_salted_blocks_apart(
    tiny_model_dir: Path, engines: list[LLMEngine], tmp_path: Path
) -> None:
    config = KVTierConfig(storage=f"file:{tmp_path / 'kv'}")
    writer = make(engines, tiny_model_dir, config)
    generate(writer, {"a": [*PREFIX, 21, 22]}, cache_salt="A")
    writer.close()  # flush its queued writes
    reader = make(engines, tiny_model_dir, config)
    assert generate(reader, {"b": [*PREFIX, 31, 32]}, cache_salt="B")["b"][1] == 0
    assert generate(reader, {"c": [*PREFIX, 41, 42]}, cache_salt="A")["c"][1] == 192
    assert tiers_of(reader).stats.storage_hit_tokens == 192


def test_preempted_request_resumes_from_storage(
    tiny_model_dir: Path, cold: LLMEngine, engines: list[LLMEngine], tmp_path: Path
) -> None:
    prompts = {"old": [*PREFIX[:64]], "new": [p + 1 for p in PREFIX[64:128]]}
    expected = {rid: generate(cold, {rid: p}, 100)[rid][0] for rid, p in prompts.items()}
    # Storage only for preempted requests (hit_count never reached): 16 device blocks
    # hold one request's 164 tokens, not two, so one is preempted and its blocks evicted.
    config = KVTierConfig(storage=f"file:{tmp_path / 'kv'}", write_policy="hit_count:1000")
    engine = make(engines, tiny_model_dir, config, num_blocks=16)
    results = generate(engine, prompts, 100)
    assert {rid: tokens for rid, (tokens, _) in results.items()} == expected
    assert engine.scheduler.stats.preemptions >= 1
    stats = tiers_of(engine).stats
    assert stats.resumed_loaded_tokens > 0
    assert stats.storage_hit_tokens == stats.resumed_loaded_tokens
    assert stats.resumed_reused_tokens >= stats.resumed_loaded_tokens


def test_hit_count_policy_writes_a_block_on_its_kth_hit(
    tiny_model_dir: Path, engines: list[LLMEngine], tmp_path: Path
) -> None:
    config = KVTierConfig(storage=f"file:{tmp_path / 'kv'}", write_policy="hit_count:2")
    engine = make(engines, tiny_model_dir, config)
    for round_ in range(3):  # found in the device cache by rounds 1 and 2
        generate(engine, {f"r{round_}": [*PREFIX, 5]})
        engine.close() if round_ == 2 else None
        written = tiers_of(engine).metrics()["storage_written_blocks"]
        assert written == (12 if round_ == 2 else 0)


def test_write_policy_and_sizes_are_validated() -> None:
    for bad in ("sometimes", "hit_count:0", "hit_count:x"):
        with pytest.raises(ValueError, match="write policy"):
            KVTierConfig(storage="file:/tmp", write_policy=bad)
    with pytest.raises(ValueError):
        KVTierConfig(host_blocks=4, host_memory=1 << 20)
    assert KVTierConfig(write_policy="hit_count:3").min_hits == 3
    assert not KVTierConfig().enabled


def test_a_full_write_queue_drops_writes_not_requests(
    tiny_model_dir: Path, cold: LLMEngine, engines: list[LLMEngine], tmp_path: Path
) -> None:
    prompt = [*PREFIX, 9]
    expected = generate(cold, {"c": prompt})["c"]
    config = KVTierConfig(storage=f"file:{tmp_path / 'kv'}", max_pending_writes=4)
    engine = make(engines, tiny_model_dir, config)
    assert generate(engine, {"a": prompt})["a"] == expected
    assert tiers_of(engine).metrics()["storage_dropped_blocks"] > 0


def test_abort_while_loading_releases_every_block(
    tiny_model_dir: Path, engines: list[LLMEngine], tmp_path: Path
) -> None:
    spec = f"file:{tmp_path / 'kv'}"
    writer = make(engines, tiny_model_dir, KVTierConfig(storage=spec))
    generate(writer, {"a": [*PREFIX, 1]})
    writer.close()
    reader = make(engines, tiny_model_dir, KVTierConfig(storage=spec))
    reader.add_request("b", [*PREFIX, 2], _params())
    reader.step()  # admission asks the store and waits
    [request] = reader.scheduler.waiting
    assert request.status is RequestStatus.WAITING
    reader.abort_request("b")
    for _ in range(20):
        reader.step()  # the load result arrives and is dropped
    assert reader.kv_cache.num_free_blocks == reader.kv_cache.num_blocks
    assert not reader.has_unfinished_requests()


class DictStorage(KVStorage):
    """A backend over a dict shared by every engine of a test: what a new backend writes
    to plug in (the engine and the tiers are not touched)."""

    stores: ClassVar[dict[str, dict[int, bytes]]] = {}

    def __init__(self, url: str, namespace: str) -> None:
        self.namespace = namespace
        self._values = self.stores.setdefault(f"{url}/{namespace}", {})

    def exists(self, keys: Sequence[int]) -> int:
        return next((i for i, key in enumerate(keys) if key not in self._values), len(keys))

    def get_many(self, keys: Sequence[int]) -> list[bytes | None]:
        return [self._values.get(key) for key in keys]

    def put_many(self, items: Sequence[tuple[int, bytes]]) -> list[int]:
        self._values.update(items)
        return []

    def delete_many(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._values.pop(key, None)


register_backend("dict", "dict:NAME", lambda url, namespace, _: DictStorage(url, namespace))


def test_a_registered_backend_serves_as_the_storage_tier(
    tiny_model_dir: Path, cold: LLMEngine, engines: list[LLMEngine]
) -> None:
    prompt = [*PREFIX, 71, 72]
    expected = generate(cold, {"c": prompt})["c"][0]
    writer = make(engines, tiny_model_dir, KVTierConfig(storage="dict:shared"))
    generate(writer, {"a": [*PREFIX, 1]})
    writer.close()
    reader = make(engines, tiny_model_dir, KVTierConfig(storage="dict:shared"))
    assert generate(reader, {"b": prompt})["b"] == (expected, 192)
    assert is_storage_url("dict:other") and "dict:NAME" in storage_usage()
    with pytest.raises(ValueError, match="already registered"):
        register_backend("dict", "dict:NAME", lambda url, namespace, _: DictStorage(url, namespace))
