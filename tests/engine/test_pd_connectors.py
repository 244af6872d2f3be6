"""Both halves of PD in one process: a prefill engine's exporter ships blocks as they are
computed, a decode engine's importer installs them under a lease and the engine
generates what a mixed engine would."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvserve.core.cost_model import profile
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.cost_model_runner import CostModelRunner
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.pd_export import PDExporter, start_export
from kvserve.engine.pd_import import LeaseLost, PDImporter, pd_importer

BLOCK_SIZE = 4
PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(45)]  # 11 full blocks before the last token
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
OPTIONS = {"block_size": BLOCK_SIZE, "num_blocks": 48, "device": "cpu", "model_name": "tiny"}
ALWAYS_REMOTE = PDConfig(min_remote_prefill_tokens=1, local_hit_fraction=1.0)


@dataclass
class CollectingSink:
    runs: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    cached_tokens: int | None = None
    error: str | None = None

    def blocks(self, first_block: int, blocks: torch.Tensor) -> None:
        self.runs.append((first_block, blocks))

    def done(self, cached_tokens: int) -> None:
        self.cached_tokens = cached_tokens

    def failed(self, message: str) -> None:
        self.error = message


def run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    engine.kv_cache.check()
    return tokens


def export(engine: LLMEngine, export_id: str, first_block: int, num_blocks: int) -> CollectingSink:
    sink = CollectingSink()
    start_export(engine, export_id, PROMPT, first_block, num_blocks, sink)
    assert run(engine) == {}  # the export's sampled token is nobody's output
    return sink


def prefill_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(model_dir, max_num_batched_tokens=12, connectors=[PDExporter], **OPTIONS)


def decode_engine(model_dir: Path, pd_config: PDConfig = ALWAYS_REMOTE) -> LLMEngine:
    return LLMEngine(model_dir, connectors=[pd_importer(pd_config, lease_ttl_s=5.0)], **OPTIONS)


Engines = tuple[LLMEngine, LLMEngine]


@pytest.fixture
def engines(tiny_model_dir: Path) -> Engines:
    return prefill_engine(tiny_model_dir), decode_engine(tiny_model_dir)


def test_transferred_prompt_generates_what_a_mixed_engine_does(
    engines: Engines, tiny_model_dir: Path
) -> None:
    prefill, decode = engines
    importer = decode.connector(PDImporter)
    reservation = importer.reserve("r1", PROMPT, now=0.0)
    assert reservation.remote and reservation.num_blocks == 11
    assert reservation.num_cached_blocks == 0
    sink = export(prefill, "x1", 0, reservation.num_blocks)
    assert sink.error is None and sink.cached_tokens == 0
    assert len(sink.runs) > 1  # shipped as chunks completed, not at the end
    for first_block, blocks in sink.runs:
        importer.install("r1", first_block, blocks, now=1.0)
    decode.add_request("r1", reservation.token_ids, GREEDY)
    tokens = run(decode)["r1"]
    mixed = LLMEngine(tiny_model_dir, **OPTIONS)
    mixed.add_request("m", PROMPT, GREEDY)
    assert tokens == run(mixed)["m"]
    assert decode.scheduler.stats.computed_tokens == 1 + 8 - 1  # the last prompt token only
    assert len(importer.leases) == 0 and importer.num_reservations == 0
    assert decode.kv_cache.num_free_blocks + decode.kv_cache.num_cached_blocks == 48


def test_prefill_worker_reuses_its_cache_and_ships_only_what_decode_lacks(
    engines: Engines,
) -> None:
    prefill, _ = engines
    first = export(prefill, "x1", 0, 11)
    again = export(prefill, "x2", 6, 11)
    assert again.cached_tokens == 11 * BLOCK_SIZE  # all its full blocks: a hit on this worker
    assert again.runs[0][0] == 6 and sum(len(b) for _, b in again.runs) == 5
    assert torch.equal(again.runs[0][1], torch.cat([b for _, b in first.runs])[6:])
    assert prefill.load()["running"] == 0


def test_short_or_held_prompts_prefill_on_the_decode_worker(tiny_model_dir: Path) -> None:
    decode = decode_engine(tiny_model_dir, PDConfig(min_remote_prefill_tokens=16))
    importer = decode.connector(PDImporter)
    short = importer.reserve("s", PROMPT[:15], now=0.0)
    assert not short.remote and len(importer.leases) == 0
    decode.add_request("warm", PROMPT, GREEDY)
    run(decode)
    held = importer.reserve("h", PROMPT, now=0.0)
    assert not held.remote and held.num_cached_blocks == 11
    assert decode.kv_cache.num_free_blocks + decode.kv_cache.num_cached_blocks == 48


def test_a_lapsed_lease_gives_its_blocks_back_and_refuses_late_blocks(
    engines: Engines,
) -> None:
    prefill, decode = engines
    importer = decode.connector(PDImporter)
    free_before = decode.kv_cache.num_free_blocks
    importer.reserve("r", PROMPT, now=0.0)
    assert decode.kv_cache.num_free_blocks == free_before - 11
    sink = export(prefill, "x", 0, 11)
    first_block, blocks = sink.runs[0]
    importer.install("r", first_block, blocks, now=4.0)  # renews to 9.0
    assert importer.expire(now=8.9) == 0
    assert importer.expire(now=9.0) == 1
    with pytest.raises(LeaseLost):
        importer.install("r", *sink.runs[1], now=9.1)
    installed = len(blocks)
    assert decode.kv_cache.num_cached_blocks == installed  # installed blocks stay cached
    assert decode.kv_cache.num_free_blocks == free_before - installed
    decode.kv_cache.check()


def test_out_of_order_blocks_are_refused_and_release_frees_everything(
    engines: Engines,
) -> None:
    prefill, decode = engines
    importer = decode.connector(PDImporter)
    importer.reserve("r", PROMPT, now=0.0)
    sink = export(prefill, "x", 0, 11)
    with pytest.raises(ValueError):
        importer.install("r", *sink.runs[1], now=0.1)
    importer.release("r")
    assert decode.kv_cache.num_free_blocks == 48 and len(importer.leases) == 0
    with pytest.raises(LeaseLost):
        importer.install("r", *sink.runs[0], now=0.2)


def test_an_export_aborted_midway_ships_nothing_more(engines: Engines) -> None:
    prefill, _ = engines
    sink = CollectingSink()
    start_export(prefill, "x", PROMPT, 0, 11, sink)
    prefill.step()
    prefill.abort_request("x")
    run(prefill)
    shipped = sum(len(b) for _, b in sink.runs)
    assert 0 < shipped < 11 and sink.cached_tokens is None
    assert prefill.load()["running"] == 0
    assert prefill.kv_cache.num_free_blocks + prefill.kv_cache.num_cached_blocks == 48


def test_a_failed_step_fails_every_export_and_drops_its_request(
    engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, _ = engines
    sink = CollectingSink()
    start_export(prefill, "x", PROMPT, 0, 11, sink)

    def broken_forward(batch: object) -> torch.Tensor:
        raise RuntimeError("device lost")

    monkeypatch.setattr(prefill.runner, "forward", broken_forward)
    with pytest.raises(RuntimeError, match="device lost"):
        prefill.step()
    assert sink.error is not None and "device lost" in sink.error
    assert not prefill.has_unfinished_requests()
    assert prefill.kv_cache.num_free_blocks == 48


def test_a_handed_over_request_aborted_before_admission_gives_the_lease_back(
    engines: Engines,
) -> None:
    prefill, decode = engines
    importer = decode.connector(PDImporter)
    reservation = importer.reserve("r", PROMPT, now=0.0)
    for first_block, blocks in export(prefill, "x", 0, 11).runs:
        importer.install("r", first_block, blocks, now=0.5)
    decode.add_request("r", reservation.token_ids, GREEDY)
    assert len(importer.leases) == 0 and importer.num_reservations == 1  # no deadline now
    decode.abort_request("r")
    assert importer.num_reservations == 0
    assert decode.kv_cache.num_free_blocks + decode.kv_cache.num_cached_blocks == 48
    assert decode.kv_cache.num_cached_blocks == 11  # installed blocks stay cached
    decode.kv_cache.check()


def test_an_export_of_a_bad_range_queues_nothing(engines: Engines) -> None:
    prefill, _ = engines
    for first_block, num_blocks in ((5, 5), (0, 12)):
        with pytest.raises(InvalidRequestError):
            start_export(prefill, "x", PROMPT, first_block, num_blocks, CollectingSink())
    assert not prefill.has_unfinished_requests()


def test_pd_needs_a_model_runner_with_a_kv_pool(tiny_model_dir: Path) -> None:
    runner = CostModelRunner(tiny_model_dir, profile("llama3-8b-h100"))
    with pytest.raises(ValueError, match="KV pool"):
        LLMEngine(tiny_model_dir, runner=runner, connectors=[PDExporter], **OPTIONS)


LONG_RUNNING = [(11 * i + 5) % 900 + 20 for i in range(20)]  # 5 blocks, growing to 30
BIG_PROMPT = [(13 * i + 1) % 900 + 20 for i in range(121)]  # 30 full blocks


def start_long_decode(decode: LLMEngine) -> None:
    params = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.0)
    decode.add_request("long", LONG_RUNNING, params)
    decode.step()
    assert decode.load()["running"] == 1


def test_blocks_held_outside_the_scheduler_preempt_a_running_decode(
    tiny_model_dir: Path,
) -> None:
    """The hazard: what a lease holds cannot be preempted, so a running sequence that
    needs to grow is preempted instead (blocks taken as a lease once took them)."""
    decode = decode_engine(tiny_model_dir)
    start_long_decode(decode)
    assert decode.kv_cache.allocate_slots("lease:big", 30 * BLOCK_SIZE)
    for _ in range(100):
        decode.step()
    assert decode.scheduler.stats.preemptions > 0
    decode.kv_cache.free_request("lease:big")


def test_a_lease_leaves_running_decodes_room_to_grow(tiny_model_dir: Path) -> None:
    decode = decode_engine(tiny_model_dir)
    importer = decode.connector(PDImporter)
    start_long_decode(decode)
    assert importer.growth_blocks() == 30 - decode.kv_cache.num_request_blocks("long")
    big = importer.reserve("big", BIG_PROMPT, now=0.0)
    assert not big.remote and len(importer.leases) == 0  # prefilled here instead
    small = importer.reserve("small", PROMPT, now=0.0, max_tokens=8)  # 11 + 3 blocks: room
    assert small.remote and len(importer.leases) == 1
    importer.release("small")
    assert run(decode)["long"] and decode.scheduler.stats.preemptions == 0
    assert importer.growth_blocks() == 0
    assert importer.reserve("big-later", BIG_PROMPT, now=1.0, max_tokens=8).remote  # none runs


LONG_LOCAL = BIG_PROMPT + PROMPT[:30]  # 151 tokens: 38 blocks, 40 with 8 generated


def test_a_lease_leaves_the_waiting_and_its_own_sequence_room_to_finish(
    tiny_model_dir: Path,
) -> None:
    """48 blocks. A local request waiting for 40 (151 + 8 tokens) leaves no lease of 11
    that room; beside one waiting for 21, a lease of 11 whose sequence may grow to 37 is
    refused, one that grows to 14 is not."""
    decode = decode_engine(tiny_model_dir)
    importer = decode.connector(PDImporter)
    decode.add_request("waiting", LONG_LOCAL, GREEDY)
    assert importer.growth_blocks() == 40
    assert not importer.reserve("r", PROMPT, now=0.0, max_tokens=8).remote
    decode.abort_request("waiting")
    decode.add_request("shorter", BIG_PROMPT[:76], GREEDY)  # 21 blocks with 8 generated
    assert not importer.reserve("r", PROMPT, now=0.0, max_tokens=100).remote  # 11 + 26 + 21
    assert importer.reserve("r", PROMPT, now=0.0, max_tokens=8).remote  # 11 + 3 + 21
    importer.release("r")


def test_a_lease_handed_over_behind_a_long_prompt_does_not_starve_it(
    engines: Engines,
) -> None:
    """The lease is granted, then a local prompt needing more than the lease leaves
    arrives, then the leased request is handed over behind it: nothing runs and the
    oldest request finds no room, so the one behind it (which holds its blocks) goes
    first; then the long one. Before, both waited for ever."""
    prefill, decode = engines
    importer = decode.connector(PDImporter)
    reservation = importer.reserve("leased", PROMPT, now=0.0, max_tokens=8)
    assert reservation.remote
    decode.add_request("long", LONG_LOCAL, GREEDY)  # 38 blocks; 37 are left beside the lease
    for first_block, blocks in export(prefill, "x", 0, reservation.num_blocks).runs:
        importer.install("leased", first_block, blocks, now=1.0)
    decode.add_request("leased", reservation.token_ids, GREEDY)
    outputs: dict[str, list[int]] = {}
    for _ in range(200):  # a starved queue would step for ever doing nothing
        for output in decode.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        if not decode.has_unfinished_requests():
            break
    assert len(outputs["leased"]) == len(outputs["long"]) == 8
    assert importer.num_reservations == 0 and decode.scheduler.stats.preemptions == 0
    decode.kv_cache.check()
