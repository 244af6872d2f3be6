"""Both halves of PD in one process: a prefill engine exports blocks as it computes them,
a decode engine installs them under a lease and generates what a mixed engine would."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.pd_engine import LeaseLost, PDEngine

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


def export(engine: PDEngine, export_id: str, first_block: int, num_blocks: int) -> CollectingSink:
    sink = CollectingSink()
    engine.start_export(export_id, PROMPT, first_block, num_blocks, sink)
    assert run(engine) == {}  # the export's sampled token is nobody's output
    return sink


@pytest.fixture
def engines(tiny_model_dir: Path) -> tuple[PDEngine, PDEngine]:
    prefill = PDEngine(tiny_model_dir, max_num_batched_tokens=12, **OPTIONS)
    decode = PDEngine(tiny_model_dir, pd_config=ALWAYS_REMOTE, lease_ttl_s=5.0, **OPTIONS)
    return prefill, decode


def test_transferred_prompt_generates_what_a_mixed_engine_does(
    engines: tuple[PDEngine, PDEngine], tiny_model_dir: Path
) -> None:
    prefill, decode = engines
    reservation = decode.reserve("r1", PROMPT, now=0.0)
    assert reservation.remote and reservation.num_blocks == 11
    assert reservation.num_cached_blocks == 0
    sink = export(prefill, "x1", 0, reservation.num_blocks)
    assert sink.error is None and sink.cached_tokens == 0
    assert len(sink.runs) > 1  # shipped as chunks completed, not at the end
    for first_block, blocks in sink.runs:
        decode.install("r1", first_block, blocks, now=1.0)
    decode.add_request("r1", reservation.token_ids, GREEDY)
    tokens = run(decode)["r1"]
    mixed = LLMEngine(tiny_model_dir, **OPTIONS)
    mixed.add_request("m", PROMPT, GREEDY)
    assert tokens == run(mixed)["m"]
    assert decode.scheduler.stats.computed_tokens == 1 + 8 - 1  # the last prompt token only
    assert len(decode.leases) == 0 and not decode._reserved
    assert decode.kv_cache.num_free_blocks + decode.kv_cache.num_cached_blocks == 48


def test_prefill_worker_reuses_its_cache_and_ships_only_what_decode_lacks(
    engines: tuple[PDEngine, PDEngine],
) -> None:
    prefill, _ = engines
    first = export(prefill, "x1", 0, 11)
    again = export(prefill, "x2", 6, 11)
    assert again.cached_tokens == 11 * BLOCK_SIZE  # all its full blocks: a hit on this worker
    assert again.runs[0][0] == 6 and sum(len(b) for _, b in again.runs) == 5
    assert torch.equal(again.runs[0][1], torch.cat([b for _, b in first.runs])[6:])
    assert prefill.load()["running"] == 0


def test_short_or_held_prompts_prefill_on_the_decode_worker(tiny_model_dir: Path) -> None:
    decode = PDEngine(tiny_model_dir, pd_config=PDConfig(min_remote_prefill_tokens=16), **OPTIONS)
    short = decode.reserve("s", PROMPT[:15], now=0.0)
    assert not short.remote and len(decode.leases) == 0
    decode.add_request("warm", PROMPT, GREEDY)
    run(decode)
    held = decode.reserve("h", PROMPT, now=0.0)
    assert not held.remote and held.num_cached_blocks == 11
    assert decode.kv_cache.num_free_blocks + decode.kv_cache.num_cached_blocks == 48


def test_a_lapsed_lease_gives_its_blocks_back_and_refuses_late_blocks(
    engines: tuple[PDEngine, PDEngine],
) -> None:
    prefill, decode = engines
    free_before = decode.kv_cache.num_free_blocks
    decode.reserve("r", PROMPT, now=0.0)
    assert decode.kv_cache.num_free_blocks == free_before - 11
    sink = export(prefill, "x", 0, 11)
    first_block, blocks = sink.runs[0]
    decode.install("r", first_block, blocks, now=4.0)  # renews to 9.0
    assert decode.expire_leases(now=8.9) == 0
    assert decode.expire_leases(now=9.0) == 1
    with pytest.raises(LeaseLost):
        decode.install("r", *sink.runs[1], now=9.1)
    installed = len(blocks)
    assert decode.kv_cache.num_cached_blocks == installed  # installed blocks stay cached
    assert decode.kv_cache.num_free_blocks == free_before - installed
    decode.kv_cache.check()


def test_out_of_order_blocks_are_refused_and_abort_frees_everything(
    engines: tuple[PDEngine, PDEngine],
) -> None:
    prefill, decode = engines
    decode.reserve("r", PROMPT, now=0.0)
    sink = export(prefill, "x", 0, 11)
    with pytest.raises(ValueError):
        decode.install("r", *sink.runs[1], now=0.1)
    decode.abort_request("r")
    assert decode.kv_cache.num_free_blocks == 48 and len(decode.leases) == 0
    with pytest.raises(LeaseLost):
        decode.install("r", *sink.runs[0], now=0.2)


def test_an_export_aborted_midway_ships_nothing_more(engines: tuple[PDEngine, PDEngine]) -> None:
    prefill, _ = engines
    sink = CollectingSink()
    prefill.start_export("x", PROMPT, 0, 11, sink)
    prefill.step()
    prefill.abort_request("x")
    run(prefill)
    shipped = sum(len(b) for _, b in sink.runs)
    assert 0 < shipped < 11 and sink.cached_tokens is None
    assert prefill.load()["running"] == 0
    assert prefill.kv_cache.num_free_blocks + prefill.kv_cache.num_cached_blocks == 48
