"""The engine's side of KV connectors: hooks around each step, several connectors on one
engine, and construction that holds nothing when a connector cannot be built."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.kv_connector import ConnectorContext, KVConnector, QueueView
from kvserve.engine.kv_tier_config import KVTierConfig
from kvserve.engine.kv_tiers.connector import KVTiers, kv_tiers
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.pd_export import PDExporter, start_export
from tests.engine.test_pd_connectors import GREEDY, OPTIONS, PROMPT, CollectingSink, run


class StepRecorder(KVConnector):
    """Records the engine hooks, and what each saw of the request it follows."""

    def __init__(self, context: ConnectorContext) -> None:
        self.cache = context.kv_cache
        self.calls: list[str] = []
        self.tables_after_step: list[int] = []

    def before_step(self, queues: QueueView) -> None:
        self.calls.append(f"before:{len(queues.running)}/{len(queues.waiting)}")

    def after_step(self, plan: SchedulerOutput) -> list[str]:
        self.calls.append("after")
        for chunk in plan.chunks:  # every block table is still readable here
            self.tables_after_step.append(len(self.cache.block_table(chunk.request.request_id)))
        return []

    def request_finished(self, request: Request) -> None:
        self.calls.append(f"finished:{request.finish_reason}")


def test_engine_hooks_run_around_each_step(tiny_model_dir: Path) -> None:
    engine = LLMEngine(tiny_model_dir, connectors=[StepRecorder], **OPTIONS)
    recorder = engine.connector(StepRecorder)
    engine.add_request("r", PROMPT[:9], GREEDY)
    engine.step()
    assert recorder.calls == ["before:0/1", "after"]
    run(engine)
    assert recorder.calls[-1] == "finished:length"
    assert recorder.calls.count("after") == 8 and all(recorder.tables_after_step)


def test_tiers_and_an_exporter_on_one_engine(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        tiny_model_dir,
        connectors=[kv_tiers(KVTierConfig(host_blocks=64)), PDExporter],
        **OPTIONS,
    )
    sink = CollectingSink()
    start_export(engine, "x", PROMPT, 0, 11, sink)
    assert run(engine) == {}
    assert sink.cached_tokens == 0 and sum(len(b) for _, b in sink.runs) == 11
    assert engine.connector(KVTiers).metrics()["host_blocks"] == 11  # offered as computed
    assert engine.connector_snapshot().keys() == {"host"}
    engine.check()
    engine.close()


def _writer_threads() -> int:
    return sum(t.name == "kvserve-kv-writer" and t.is_alive() for t in threading.enumerate())


def test_a_connector_that_cannot_be_built_closes_those_built_before(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    def unbuildable(context: ConnectorContext) -> KVConnector:
        raise ValueError("no such transfer")

    before = _writer_threads()
    storage = kv_tiers(KVTierConfig(storage=f"file:{tmp_path}"))
    with pytest.raises(ValueError, match="no such transfer"):
        LLMEngine(tiny_model_dir, connectors=[storage, unbuildable], **OPTIONS)
    assert _writer_threads() == before


def test_an_engine_without_the_connector_says_so(tiny_model_dir: Path) -> None:
    engine = LLMEngine(tiny_model_dir, **OPTIONS)
    with pytest.raises(LookupError, match="PDExporter"):
        engine.connector(PDExporter)
    assert engine.connector_metrics() == {} and engine.connector_snapshot() == {}
