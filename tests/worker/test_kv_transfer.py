"""The TCP KV transfer between two engines in one process: the sender serves a prefill
engine's exports, the receiver installs them into a decode engine's reservation; and
every failure reaches the decode side as a KVTransferError."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from aiohttp import web

from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.kv_block_io import KVBlockLayout
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.pd_export import PDExporter
from kvserve.engine.pd_import import PDImporter, pd_importer
from kvserve.router.ports import free_port
from kvserve.worker.engine_bridge import EngineBridge
from kvserve.worker.engine_state import probe_engine
from kvserve.worker.kv_transfer import EngineExports, KVTransferError
from kvserve.worker.tcp_kv_transfer import TCPKVReceiver, TCPKVSender

OPTIONS = {"block_size": 4, "num_blocks": 48, "device": "cpu", "model_name": "tiny"}
PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(45)]  # 11 full blocks before the last token
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
ALWAYS_REMOTE = PDConfig(min_remote_prefill_tokens=1, local_hit_fraction=1.0)


def run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


@pytest.fixture
async def prefill_url(tiny_model_dir: Path) -> AsyncIterator[str]:
    """A prefill engine behind its bridge and TCP sender, and ``/pd/info`` naming it."""
    torch.set_num_threads(1)
    engine = LLMEngine(tiny_model_dir, max_num_batched_tokens=12, connectors=[PDExporter],
                       **OPTIONS)  # fmt: skip
    bridge = EngineBridge(engine, probe_engine)
    bridge.start()
    sender = TCPKVSender(EngineExports(bridge), engine.connector(PDExporter).layout, "127.0.0.1")
    await sender.start()

    async def info(_: web.Request) -> web.Response:
        return web.json_response(sender.info())

    app = web.Application()
    app.router.add_get("/pd/info", info)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await sender.close()
        await bridge.shutdown()
        assert engine.load()["running"] == 0
        engine.check()


def decode_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(model_dir, connectors=[pd_importer(ALWAYS_REMOTE)], **OPTIONS)


async def test_blocks_travel_and_the_decode_engine_generates_the_mixed_output(
    tiny_model_dir: Path, prefill_url: str
) -> None:
    decode = decode_engine(tiny_model_dir)
    importer = decode.connector(PDImporter)
    reservation = importer.reserve("r", PROMPT, now=0.0)
    runs: list[int] = []

    async def install(first_block: int, blocks: torch.Tensor) -> None:
        runs.append(first_block)
        importer.install("r", first_block, blocks, now=0.0)

    receiver = TCPKVReceiver(importer.layout, frame_timeout_s=30.0)
    try:
        cached = await receiver.fetch(prefill_url, reservation.token_ids, 0, 11, install)
    finally:
        receiver.close()  # the shared segment it kept for a next transfer
    # Runs follow the prefill's chunks, merged when the sender falls behind (a loaded box
    # may send all 11 blocks as one): in order from block 0, each once.
    assert cached == 0 and runs[0] == 0 and runs == sorted(set(runs))
    decode.add_request("r", reservation.token_ids, GREEDY)
    mixed = LLMEngine(tiny_model_dir, **OPTIONS)
    mixed.add_request("m", PROMPT, GREEDY)
    assert run(decode)["r"] == run(mixed)["m"]
    assert decode.scheduler.stats.computed_tokens == 8  # the last prompt token, 7 decodes
    decode.check()
    receiver.close()  # the same-host segment it kept is unlinked
    assert not [name for name in os.listdir("/dev/shm") if f"-{os.getpid()}-" in name]


async def test_a_foreign_layout_is_refused_by_the_sender(
    tiny_model_dir: Path, prefill_url: str
) -> None:
    decode = decode_engine(tiny_model_dir)
    layout = decode.connector(PDImporter).layout
    foreign = KVBlockLayout("other", layout.num_layers, layout.block_size,
                            layout.num_kv_heads, layout.head_dim, layout.dtype)  # fmt: skip

    async def install(first_block: int, blocks: torch.Tensor) -> None:
        raise AssertionError("nothing may arrive")

    with pytest.raises(KVTransferError, match="layout"):
        await TCPKVReceiver(foreign, 30.0).fetch(prefill_url, PROMPT, 0, 11, install)


async def test_a_failed_install_and_an_unreachable_peer_are_transfer_errors(
    tiny_model_dir: Path, prefill_url: str
) -> None:
    decode = decode_engine(tiny_model_dir)
    importer = decode.connector(PDImporter)
    receiver = TCPKVReceiver(importer.layout, frame_timeout_s=30.0)

    async def install_without_lease(first_block: int, blocks: torch.Tensor) -> None:
        importer.install("never-reserved", first_block, blocks, now=0.0)

    with pytest.raises(KVTransferError, match="LeaseLost"):
        await receiver.fetch(prefill_url, PROMPT, 0, 11, install_without_lease)
    with pytest.raises(KVTransferError):
        await receiver.fetch(f"http://127.0.0.1:{free_port()}", PROMPT, 0, 11,
                             install_without_lease)  # fmt: skip
