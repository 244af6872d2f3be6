"""One generation request from submission to the last byte, streamed or not.

Whatever ends the request early (the client hanging up, the handler being cancelled at
shutdown, an engine fault) aborts it in the engine, so that its blocks are freed at once
and never wait for a generation nobody will read.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive

from kvserve.worker import tool_calls
from kvserve.worker.engine_bridge import RequestAborted
from kvserve.worker.errors import APIError
from kvserve.worker.json_response import JSONResponse
from kvserve.worker.metrics import RequestTimer, WorkerMetrics
from kvserve.worker.responses import ResponseFormat, usage
from kvserve.worker.tool_call_stream import ToolCallStream
from kvserve.worker.tool_calls import ParsedOutput, ToolPlan

_SSE_DONE = b"data: [DONE]\n\n"
# The engine ends a request with "error" when its grammar library failed on it.
_GRAMMAR_FAILED = "error"

T = TypeVar("T")

# Request ids: a random tag per process plus a counter. uuid4 per request costs a
# getrandom() system call each, which shows in the per-request overhead.
_PROCESS_TAG = uuid.uuid4().hex[:12]
_REQUEST_NUMBERS = itertools.count()


class OutputStream(Protocol):
    """One request's outputs in order (a ``RequestStream``, or a view of one)."""

    @property
    def finished(self) -> bool: ...
    def __aiter__(self) -> AsyncIterator[Any]: ...


class GenerationBackend(Protocol):
    """What runs generations: the engine thread bridge (``EngineBridge``), or a decode
    worker's PD session in its place."""

    engine: Any  # the LLMEngine behind it, read for its model name, context and tokenizer

    async def generate(self, request_id: str, prompt: Any, params: Any) -> OutputStream: ...
    def abort(self, request_id: str) -> None: ...


class Generation:
    """The per-request context shared by the streamed and the collected paths."""

    def __init__(
        self,
        backend: GenerationBackend,
        metrics: WorkerMetrics,
        fmt: ResponseFormat,
        model: str,
        tools: ToolPlan | None = None,  # the answer is read back as tool calls
    ) -> None:
        self.backend = backend
        self.fmt = fmt
        self.model = model
        self.tools = tools
        self.request_id = f"{fmt.id_prefix}{_PROCESS_TAG}{next(_REQUEST_NUMBERS):08x}"
        self.created = int(time.time())
        self.timer: RequestTimer = metrics.start_request()

    async def respond(
        self, request: Request, prompt: Any, params: Any, *, stream: bool, include_usage: bool
    ) -> Response:
        outputs = await self.backend.generate(self.request_id, prompt, params)
        if stream:
            return StreamingResponse(
                self._events(outputs, include_usage), media_type="text/event-stream"
            )
        try:
            return await self._collect(request.receive, outputs)
        finally:
            self._abort_unless_finished(outputs)

    def _abort_unless_finished(self, outputs: OutputStream) -> None:
        if not outputs.finished:
            self.backend.abort(self.request_id)
            self.timer.on_abort()

    async def _collect(self, receive: Receive, outputs: OutputStream) -> Response:
        texts: list[str] = []

        async def consume() -> Any:
            last = None
            async for output in outputs:
                self.timer.on_output(output)
                texts.append(output.new_text)
                last = output
            return last

        try:
            last = await _unless_disconnected(receive, consume())
        except RequestAborted as exc:
            raise APIError(503, f"Request aborted: {exc}") from exc
        if last is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if last.finish_reason == _GRAMMAR_FAILED:
            raise _grammar_failed()
        text = "".join(texts)
        body = self.fmt.response(
            self.request_id,
            self.model,
            self.created,
            text,
            last.finish_reason,
            usage(last.prompt_tokens, last.completion_tokens, last.num_cached_tokens),
        )
        if self.tools is not None:
            parsed = self.tools.parse(text)
            choice = body["choices"][0]
            choice["message"] = tool_calls.message(parsed)
            choice["finish_reason"] = tool_calls.finish_reason(parsed, last.finish_reason)
        return JSONResponse(body)

    async def _events(self, outputs: OutputStream, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events; a cancelled iteration (client gone) aborts the request.

        A chat stream's role chunk goes out with the first output, not before: the first
        byte of a stream then means the prompt is computed, which is when a router lets go
        of the prefill load it holds for the request (sent at once, it would be released
        before prefill even started)."""
        try:
            opening = self.fmt.opening_choice()
            last = None
            calls = ToolCallStream(self.tools) if self.tools is not None else None
            async for output in outputs:
                if opening is not None:
                    yield self._sse([opening], include_usage)
                    opening = None
                self.timer.on_output(output)
                last = output
                finish = output.finish_reason if output.finished else None
                if finish == _GRAMMAR_FAILED:
                    yield b"data: " + orjson.dumps(_grammar_failed().body()) + b"\n\n"
                    break
                if calls is not None:
                    content = calls.push(output.new_text)
                    if content:
                        yield self._sse([self.fmt.delta_choice(content, None)], include_usage)
                    if finish is not None:
                        yield self._sse([self._tool_delta(calls.finish(), finish)], include_usage)
                elif output.new_text or finish is not None:
                    yield self._sse([self.fmt.delta_choice(output.new_text, finish)], include_usage)
            if include_usage and last is not None:
                counts = usage(last.prompt_tokens, last.completion_tokens, last.num_cached_tokens)
                yield self._sse([], include_usage, counts)
        except RequestAborted as exc:
            error = APIError(503, f"Request aborted: {exc}")
            yield b"data: " + orjson.dumps(error.body()) + b"\n\n"
        finally:
            self._abort_unless_finished(outputs)
        yield _SSE_DONE

    def _tool_delta(self, parsed: ParsedOutput, finish: str) -> dict[str, Any]:
        choice = self.fmt.delta_choice("", tool_calls.finish_reason(parsed, finish))
        choice["delta"] = tool_calls.delta(parsed)
        return choice

    def _sse(
        self,
        choices: list[dict[str, Any]],
        include_usage: bool,
        usage_body: dict[str, Any] | None = None,
    ) -> bytes:
        body = self.fmt.chunk(self.request_id, self.model, self.created, choices)
        if include_usage:
            body["usage"] = usage_body
        return b"data: " + orjson.dumps(body) + b"\n\n"


def _grammar_failed() -> APIError:
    return APIError(
        500,
        "Structured output failed in the grammar library; the worker log has the cause.",
        code="structured_output_failed",
    )


async def _unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
    """Awaits ``work`` in this task; returns None (cancelling it) if the client disconnects
    first. A watcher task cancels this one on disconnect: cheaper than running ``work`` in a
    task of its own and racing the two with ``asyncio.wait``."""
    task = asyncio.current_task()
    assert task is not None, "called from a coroutine, so within a task"
    watching = True
    disconnected = False

    def on_disconnect(watcher: asyncio.Task[None]) -> None:
        nonlocal disconnected
        if watching and not watcher.cancelled():
            disconnected = True
            task.cancel()

    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    watcher.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if disconnected and task.uncancel() == 0:
            return None  # cancelled by the watcher alone, not also from outside
        raise
    finally:
        watching = False
        watcher.cancel()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
