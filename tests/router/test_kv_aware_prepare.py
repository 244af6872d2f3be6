"""The router prepares kv_aware's queries (tokenizing) off its event loop: the loop keeps
running while long prompts are encoded, and the prepared hashes are the synchronous ones."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.types import RouteQuery, WorkerLoad
from kvserve.router.kv_event_subscriber import WorkerKVInfo
from kvserve.router.prompt_preparer import PromptPreparer
from kvserve.router.prompt_tokens import PromptHasher

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("kv-prepare-model"), "llama")


def preparer_for(model_dir: Path) -> PromptPreparer:
    preparer = PromptPreparer()
    preparer.learn_worker("w0", WorkerKVInfo(block_size=BLOCK, models=(str(model_dir),)))
    return preparer


def query(body: dict) -> RouteQuery:
    return RouteQuery(text="", model=body["model"], prefill_tokens=1, body=body)


async def test_prepared_hashes_are_the_synchronous_ones(model_dir: Path) -> None:
    preparer, hasher = preparer_for(model_dir), PromptHasher(model_dir)
    policy = KvAwarePolicy(KvAwareConfig())
    chat = {"role": "user", "content": "Rivers and bridges in winter. " * 20}
    bodies = [
        {"model": str(model_dir), "messages": [chat]},
        {"model": str(model_dir), "prompt": "Harbours, tides and ships. " * 20},
        {"model": str(model_dir), "prompt": list(range(3, 70))},
        # past SYNC_ENCODE_MAX_CHARS: encoded on the tokenizer's threads instead
        {"model": str(model_dir), "prompt": "Lanterns along the quay. " * 400},
    ]
    for body in bodies:
        prepared = await preparer.prepare(query(body))
        assert prepared.blocks is not None and prepared.blocks == hasher.blocks(body, BLOCK)
        assert prepared.body is body and prepared.model == str(model_dir)
        decision = policy.select(prepared, [WorkerLoad("w0")], now=0.0)
        assert decision.reason != "no_tokenizer"


async def test_a_body_the_worker_refuses_routes_by_load(model_dir: Path) -> None:
    prepared = await preparer_for(model_dir).prepare(
        query({"model": str(model_dir), "prompt": [1, "x"]})
    )
    decision = KvAwarePolicy(KvAwareConfig()).select(prepared, [WorkerLoad("w0")], now=0.0)
    assert decision.reason == "no_tokenizer"


async def test_the_loop_keeps_running_while_long_prompts_are_tokenized(model_dir: Path) -> None:
    """A synchronous encode would finish every long prompt before the ticker's first
    step; the async one lets the loop serve other work (here, ticks and a short prompt's
    preparation) while the long prompts are still being encoded."""
    preparer = preparer_for(model_dir)
    long_body = {"model": str(model_dir), "prompt": "Shared context about tides. " * 60_000}
    short_body = {"model": str(model_dir), "prompt": "A short question."}
    events: list[str] = []

    async def prepare_long() -> None:
        await preparer.prepare(query(long_body))
        events.append("long")

    async def serve_meanwhile() -> None:
        await asyncio.sleep(0)
        events.append("tick")
        prepared = await preparer.prepare(query(short_body))
        assert prepared.blocks is not None
        events.append("short")

    await asyncio.gather(*(prepare_long() for _ in range(3)), serve_meanwhile())
    assert events.index("tick") < events.index("short") < events.index("long"), events


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "hi", "name": "ann"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
        {
            "messages": [
                {"role": "user", "content": "weather?", "name": "ann"},
                {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
        {"prompt": ["first prompt routes", "second one does not"]},
        {"prompt": [[5, 6, 7, 8], [9, 10]]},
    ],
)
def test_the_router_hashes_the_tokens_the_worker_computes_first(model_dir: Path, body) -> None:
    """The router's tokens of a body are the worker's (chat: the same messages handed to
    the same template; a list of prompts: its first)."""
    from kvserve.model_folder.tokenizer import Tokenizer
    from kvserve.worker.protocol import ChatCompletionRequest, CompletionRequest

    body = {"model": "tiny", **body}
    tokenizer = Tokenizer(model_dir)
    if "messages" in body:
        request = ChatCompletionRequest.model_validate(body)
        messages, tools = request.template_input()
        worker = tokenizer.encode_chat(messages, tools=tools)
    else:
        first = CompletionRequest.model_validate(body).prompts()[0]
        worker = tokenizer.encode(first) if isinstance(first, str) else first
    assert PromptHasher(model_dir).prompt_tokens(body) == worker
