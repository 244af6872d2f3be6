"""One generation request from submission to the last byte, streamed or not.

A router asks a non-streamed answer's headers to be sent with the first token
(``x-kvserve-first-token: headers``), so that it learns when prefill ended without
streaming: the body follows when generation ends, and the response says so with
``x-kvserve-first-token: 1`` (a worker that ignores the request sends neither). An engine
fault after the headers can no longer change the status: the body is then the OpenAI
error body, which the router turns back into a 503.

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
from starlette.types import Receive, Scope, Send

from kvserve.worker.engine_bridge import RequestAborted
from kvserve.worker.errors import APIError
from kvserve.worker.json_response import JSONResponse
from kvserve.worker.metrics import RequestTimer, WorkerMetrics
from kvserve.worker.responses import ResponseFormat, usage

_SSE_DONE = b"data: [DONE]\n\n"
FIRST_TOKEN_HEADER = "x-kvserve-first-token"
FIRST_TOKEN_REQUEST = "headers"

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
        self, backend: GenerationBackend, metrics: WorkerMetrics, fmt: ResponseFormat, model: str
    ) -> None:
        self.backend = backend
        self.fmt = fmt
        self.model = model
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
        if request.headers.get(FIRST_TOKEN_HEADER) == FIRST_TOKEN_REQUEST:
            return await self._collect_after_first_token(request.receive, outputs)
        try:
            return await self._collect(request.receive, outputs)
        finally:
            self._abort_unless_finished(outputs)

    def _abort_unless_finished(self, outputs: OutputStream) -> None:
        if not outputs.finished:
            self.backend.abort(self.request_id)
            self.timer.on_abort()

    async def _collect(self, receive: Receive, outputs: OutputStream) -> Response:
        collected = _Collected()
        try:
            last = await _unless_disconnected(receive, collected.rest(self, aiter(outputs)))
        except RequestAborted as exc:
            raise APIError(503, f"Request aborted: {exc}") from exc
        if last is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(self._body(collected, last))

    async def _collect_after_first_token(self, receive: Receive, outputs: OutputStream) -> Response:
        """Wait for the first output only, then answer with a response that sends its
        headers at once and the body when the rest is collected. Until the headers go
        out, failures are reported with their own status, as by ``_collect``."""
        collected = _Collected()
        iterator = aiter(outputs)
        try:
            first = await _unless_disconnected(receive, collected.next(self, iterator))
        except RequestAborted as exc:
            self._abort_unless_finished(outputs)
            raise APIError(503, f"Request aborted: {exc}") from exc
        except BaseException:
            self._abort_unless_finished(outputs)
            raise
        if first is None:
            self._abort_unless_finished(outputs)
            return Response(status_code=499)
        return _AfterFirstTokenResponse(self, outputs, iterator, collected, first)

    def _body(self, collected: _Collected, last: Any) -> dict[str, Any]:
        return self.fmt.response(
            self.request_id,
            self.model,
            self.created,
            "".join(collected.texts),
            last.finish_reason,
            usage(last.prompt_tokens, last.completion_tokens, last.num_cached_tokens),
        )

    async def _events(self, outputs: OutputStream, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events; a cancelled iteration (client gone) aborts the request.

        A chat stream's role chunk goes out with the first output, not before: the first
        byte of a stream then means the prompt is computed, which is when a router lets go
        of the prefill load it holds for the request (sent at once, it would be released
        before prefill even started)."""
        try:
            opening = self.fmt.opening_choice()
            last = None
            async for output in outputs:
                if opening is not None:
                    yield self._sse([opening], include_usage)
                    opening = None
                self.timer.on_output(output)
                last = output
                finish = output.finish_reason if output.finished else None
                if output.new_text or finish is not None:
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


class _Collected:
    """The text of a non-streamed answer so far."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def next(self, generation: Generation, iterator: AsyncIterator[Any]) -> Any:
        """The next output (None at the end), its text kept."""
        output = await anext(iterator, None)
        if output is not None:
            generation.timer.on_output(output)
            self.texts.append(output.new_text)
        return output

    async def rest(self, generation: Generation, iterator: AsyncIterator[Any]) -> Any:
        """Every output left; the last one (None if there was none)."""
        last = None
        while (output := await self.next(generation, iterator)) is not None:
            last = output
        return last


class _AfterFirstTokenResponse(Response):
    """A non-streamed answer whose headers leave with the first token and whose body
    follows when generation ends; the client leaving meanwhile aborts the generation."""

    media_type = "application/json"

    def __init__(
        self,
        generation: Generation,
        outputs: OutputStream,
        iterator: AsyncIterator[Any],
        collected: _Collected,
        first: Any,
    ) -> None:
        self.status_code = 200
        self.background = None
        self._generation = generation
        self._outputs = outputs
        self._iterator = iterator
        self._collected = collected
        self._first = first
        self.init_headers({FIRST_TOKEN_HEADER: "1"})  # no body yet: no content-length

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        generation = self._generation
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                rest = self._collected.rest(generation, self._iterator)
                last = await _unless_disconnected(receive, rest)
            except RequestAborted as exc:
                body = APIError(503, f"Request aborted: {exc}").body()
            else:
                if last is None and not self._outputs.finished:
                    return  # the client is gone
                body = generation._body(self._collected, last or self._first)
        finally:
            generation._abort_unless_finished(self._outputs)
        await send({"type": "http.response.body", "body": orjson.dumps(body)})


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
