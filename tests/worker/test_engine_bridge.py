"""The engine-thread bridge with a real engine, in-process: fault and shutdown paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.worker.engine_bridge import EngineBridge, RequestAborted, RequestStream
from kvserve.worker.engine_state import probe_engine

LONG = SamplingParams(max_tokens=500, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir: Path) -> LLMEngine:
    torch.set_num_threads(1)
    return LLMEngine(tiny_model_dir, num_blocks=64, device="cpu")


def assert_all_blocks_released(bridge: EngineBridge) -> None:
    state = bridge.state
    assert state.running == state.waiting == 0
    assert state.free_blocks + state.cached_blocks == state.total_blocks


async def first_output(
    bridge: EngineBridge, request_id: str, params: SamplingParams
) -> tuple[RequestStream, RequestOutput]:
    stream = await bridge.generate(request_id, [5, 6, 7, 8], params)
    return stream, await anext(aiter(stream))


async def test_a_failing_step_aborts_its_requests_and_the_engine_serves_on(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    bridge = EngineBridge(engine, probe_engine)
    bridge.start()
    stream, _ = await first_output(bridge, "doomed", LONG)

    def broken_forward(*_args: object) -> torch.Tensor:
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine.runner, "forward", broken_forward)
    with pytest.raises(RequestAborted, match="injected device fault"):
        async for _ in stream:
            pass
    await bridge.call(lambda e: e.kv_cache.check())
    assert_all_blocks_released(bridge)

    monkeypatch.undo()
    healthy = await bridge.generate("after", [5, 6, 7, 8], SamplingParams(max_tokens=2))
    assert [output.finished async for output in healthy] == [False, True]
    await bridge.shutdown()


async def test_shutdown_aborts_in_flight_requests_and_frees_their_blocks(
    engine: LLMEngine,
) -> None:
    bridge = EngineBridge(engine, probe_engine)
    bridge.start()
    streams = [(await first_output(bridge, f"r{i}", LONG))[0] for i in range(3)]
    await bridge.shutdown()
    for stream in streams:
        with pytest.raises(RequestAborted, match="shut down"):
            async for _ in stream:
                pass
    assert not bridge.is_running()
    engine.kv_cache.check()
    assert_all_blocks_released(bridge)


async def test_an_aborted_request_frees_its_blocks_before_the_next_step(
    engine: LLMEngine,
) -> None:
    bridge = EngineBridge(engine, probe_engine)
    bridge.start()
    await first_output(bridge, "dropped", LONG)
    bridge.abort("dropped")
    state = await bridge.call(probe_engine)  # runs after the abort: commands keep order
    assert state.free_blocks + state.cached_blocks == state.total_blocks
    assert not engine.has_unfinished_requests()
    await bridge.shutdown()


async def test_an_invalid_request_is_refused_without_a_trace(engine: LLMEngine) -> None:
    bridge = EngineBridge(engine, probe_engine)
    bridge.start()
    with pytest.raises(ValueError, match="prompt"):
        await bridge.generate("too-long", [3] * (engine.max_model_len + 1), LONG)
    assert not engine.has_unfinished_requests()
    await bridge.shutdown()
