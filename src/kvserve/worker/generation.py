"""One generation request from submission to the last byte, streamed or not.

A request is one or more choices (``n`` per prompt, one or more prompts), each an engine
request (:mod:`kvserve.worker.choices`); their outputs are merged into one response whose
choices keep their indexes. Whatever ends the request early (the client hanging up, the
handler being cancelled at shutdown, an engine fault) aborts every choice still running
in the engine, so that its blocks are freed at once and never wait for a generation
nobody will read.

A router asks a non-streamed answer's headers to be sent once prefill is over
(``x-kvserve-first-token: headers``), so that it learns when to let go of the prefill
load it holds without streaming: the headers leave when every choice has its first token
(``x-kvserve-first-token: 1``), the body when generation ends (a worker that ignores the
request sends neither). An engine fault after the headers can no longer change the
status: the body is then the OpenAI error body, which the router turns back into a 503.

A chat request with tools reads each choice's answer back as tool calls
(:mod:`kvserve.worker.tool_calls`): every choice on its own, collected or streamed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.engine.logprobs import TokenLogprob
from kvserve.worker import tool_calls
from kvserve.worker.choices import ChoicePlan, ChoiceSet
from kvserve.worker.engine_bridge import RequestAborted
from kvserve.worker.errors import APIError
from kvserve.worker.generation_backend import GenerationBackend
from kvserve.worker.json_response import JSONResponse
from kvserve.worker.logprob_format import LegacyLogprobs, TokenTexts, chat_logprobs
from kvserve.worker.metrics import RequestTimer, WorkerMetrics
from kvserve.worker.responses import ResponseFormat, usage
from kvserve.worker.tool_call_stream import ToolCallStream
from kvserve.worker.tool_calls import ToolPlan

_SSE_DONE = b"data: [DONE]\n\n"
FIRST_TOKEN_HEADER = "x-kvserve-first-token"
FIRST_TOKEN_REQUEST = "headers"
# The engine ends a request with "error" when its grammar library failed on it.
_GRAMMAR_FAILED = "error"

T = TypeVar("T")

# Request ids: a random tag per process plus a counter. uuid4 per request costs a
# getrandom() system call each, which shows in the per-request overhead.
_PROCESS_TAG = uuid.uuid4().hex[:12]
_REQUEST_NUMBERS = itertools.count()


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """How the choices' outputs are shown: echoed prompts, logprobs, usage in a stream,
    tool calls read back from the answers."""

    echo_texts: list[str] | None = None  # per prompt: text to put before each choice's
    logprobs: bool = False  # the choices' logprobs are returned
    include_usage: bool = False
    # best_of: the choices of a prompt returned are this many with the highest sum of
    # sampled-token logprobs (None: all, in order)
    keep_best: int | None = None
    tools: ToolPlan | None = None


@dataclass(slots=True)
class _Choice:
    """What one choice has produced so far."""

    plan: ChoicePlan
    timer: RequestTimer
    texts: list[str] = field(default_factory=list)
    legacy: LegacyLogprobs | None = None  # completions' logprobs
    chat: list[TokenLogprob] = field(default_factory=list)  # chat's, this delta's
    chat_all: list[TokenLogprob] = field(default_factory=list)
    started: bool = False
    last: Any = None  # its latest output
    cumulative_logprob: float = 0.0  # of its sampled tokens
    calls: ToolCallStream | None = None  # a streamed answer's held tool calls


class Generation:
    """The per-request context shared by the streamed and the collected paths."""

    def __init__(
        self,
        backend: GenerationBackend,
        metrics: WorkerMetrics,
        fmt: ResponseFormat,
        model: str,
        plans: list[ChoicePlan],
        options: ResponseOptions,
        token_texts: TokenTexts,
    ) -> None:
        self.fmt = fmt
        self.model = model
        self.options = options
        self.request_id = f"{fmt.id_prefix}{_PROCESS_TAG}{next(_REQUEST_NUMBERS):08x}"
        self.created = int(time.time())
        self._metrics = metrics
        self._texts = token_texts
        self._choice_set = ChoiceSet(backend, self.request_id, plans)
        self._choices = [_Choice(plan, metrics.start_request()) for plan in plans]
        # Prompt logprobs come with the first choice of each prompt; its siblings and
        # echo copy them.
        self._prompt_logprobs: dict[int, tuple[list[int], list[TokenLogprob | None]]] = {}

    async def respond(self, request: Request, *, stream: bool) -> Response:
        await self._choice_set.start()
        if stream:
            return StreamingResponse(self._events(), media_type="text/event-stream")
        if request.headers.get(FIRST_TOKEN_HEADER) == FIRST_TOKEN_REQUEST:
            return await self._collect_after_first_tokens(request.receive)
        try:
            return await self._collect(request.receive)
        finally:
            self._abort_unfinished()

    def _abort_unfinished(self) -> None:
        for index in self._choice_set.abort_unfinished():
            self._choices[index].timer.on_abort()

    async def _collect(self, receive: Receive) -> Response:
        outputs = aiter(self._choice_set.outputs())
        try:
            done = await _unless_disconnected(receive, self._take_rest(outputs))
        except RequestAborted as exc:
            raise APIError(503, f"Request aborted: {exc}") from exc
        if done is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if self._any_grammar_failed():
            raise _grammar_failed()
        return JSONResponse(self._body())

    async def _collect_after_first_tokens(self, receive: Receive) -> Response:
        """Wait until every choice has its first token, then answer with a response that
        sends its headers at once and the body when the rest is collected. Until the
        headers go out, failures are reported with their own status, as by ``_collect``."""
        outputs = aiter(self._choice_set.outputs())
        try:
            started = await _unless_disconnected(receive, self._take_until_started(outputs))
        except RequestAborted as exc:
            self._abort_unfinished()
            raise APIError(503, f"Request aborted: {exc}") from exc
        except BaseException:
            self._abort_unfinished()
            raise
        if started is None:
            self._abort_unfinished()
            return Response(status_code=499)
        return _AfterFirstTokensResponse(self, outputs)

    async def _take_next(self, outputs: AsyncIterator[tuple[int, Any]]) -> bool:
        """Takes the next output of any choice; False when every choice has ended."""
        item = await anext(outputs, None)
        if item is None:
            return False
        index, output = item
        self._take(self._choices[index], output)
        return True

    async def _take_until_started(self, outputs: AsyncIterator[tuple[int, Any]]) -> bool:
        while not all(choice.started for choice in self._choices):
            if not await self._take_next(outputs):
                break
        return True

    async def _take_rest(self, outputs: AsyncIterator[tuple[int, Any]]) -> bool:
        while await self._take_next(outputs):
            pass
        return True

    def _body(self) -> dict[str, Any]:
        choices = [self._whole_choice(index, c) for index, c in enumerate(self._returned())]
        return self.fmt.response(self.request_id, self.model, self.created, choices, self._usage())

    def _any_grammar_failed(self) -> bool:
        return any(c.last.finish_reason == _GRAMMAR_FAILED for c in self._choices)

    async def _events(self) -> AsyncIterator[bytes]:
        """Server-sent events; a cancelled iteration (client gone) aborts the requests.

        A chat stream's role chunk goes out with a choice's first output, not before: the
        first byte of a stream then means the prompt is computed, which is when a router
        lets go of the prefill load it holds for the request (sent at once, it would be
        released before prefill even started)."""
        try:
            async for index, output in self._choice_set.outputs():
                choice = self._choices[index]
                if not choice.started:
                    opening = self.fmt.opening_choice(index)
                    if opening is not None:
                        yield self._sse([opening])
                text = self._take(choice, output)
                finish = output.finish_reason if output.finished else None
                if finish == _GRAMMAR_FAILED:
                    yield b"data: " + orjson.dumps(_grammar_failed().body()) + b"\n\n"
                    break
                for delta in self._deltas(index, choice, text, finish):
                    yield self._sse([delta])
            if self.options.include_usage:
                yield self._sse([], self._usage())
        except RequestAborted as exc:
            error = APIError(503, f"Request aborted: {exc}")
            yield b"data: " + orjson.dumps(error.body()) + b"\n\n"
        finally:
            self._abort_unfinished()
        yield _SSE_DONE

    def _whole_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        """A collected choice; with tools its answer is read back as calls, choice by
        choice (each choice is its own answer)."""
        text = "".join(choice.texts)
        reason = choice.last.finish_reason
        body = self.fmt.choice(index, text, reason, self._whole_logprobs(choice))
        if self.options.tools is not None:
            parsed = self.options.tools.parse(text)
            body["message"] = tool_calls.message(parsed)
            body["finish_reason"] = tool_calls.finish_reason(parsed, reason)
        return body

    def _deltas(
        self, index: int, choice: _Choice, text: str, finish: str | None
    ) -> list[dict[str, Any]]:
        """The stream chunks' choices for one output of a choice: its text (with tools,
        what may be streamed of it now) and logprobs, and with tools its calls at the end."""
        logprobs = self._delta_logprobs(choice)
        if self.options.tools is None:
            if text or finish is not None or logprobs is not None:
                return [self.fmt.delta_choice(index, text, finish, logprobs)]
            return []
        if choice.calls is None:
            choice.calls = ToolCallStream(self.options.tools)
        deltas = []
        content = choice.calls.push(text)
        if content or logprobs is not None:
            deltas.append(self.fmt.delta_choice(index, content, None, logprobs))
        if finish is not None:
            parsed = choice.calls.finish()
            last = self.fmt.delta_choice(index, "", tool_calls.finish_reason(parsed, finish), None)
            last["delta"] = tool_calls.delta(parsed)
            deltas.append(last)
        return deltas

    def _take(self, choice: _Choice, output: Any) -> str:
        """Records one output of a choice; returns the text it adds to the choice."""
        choice.timer.on_output(output)
        choice.last = output
        plan = choice.plan
        text = output.new_text
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[plan.prompt_index] = (
                output.prompt_token_ids,
                output.prompt_logprobs,
            )
        if not choice.started:
            choice.started = True
            if self.options.echo_texts is not None:
                text = self.options.echo_texts[plan.prompt_index] + text
                if self.options.logprobs:
                    token_ids, entries = self._prompt_logprobs[plan.prompt_index]
                    self._legacy(choice).add(entries, token_ids)
        if plan.fork_of is not None and output.finished:
            self._metrics.forked_choices.inc()
            self._metrics.forked_prompt_tokens.inc(output.num_cached_tokens)
        if output.logprobs is not None:
            choice.cumulative_logprob += sum(entry.logprob for entry in output.logprobs)
            if self.fmt.chat:
                choice.chat.extend(output.logprobs)
                choice.chat_all.extend(output.logprobs)
            else:
                self._legacy(choice).add(output.logprobs, output.new_token_ids)
        choice.texts.append(text)
        return str(text)

    def _returned(self) -> list[_Choice]:
        """The choices the response carries, in index order: with ``best_of``, the
        ``keep_best`` of each prompt with the highest cumulative logprob (ties: the
        lower index)."""
        keep = self.options.keep_best
        per_prompt: dict[int, list[_Choice]] = {}
        for choice in self._choices:
            per_prompt.setdefault(choice.plan.prompt_index, []).append(choice)
        if keep is None or all(len(group) <= keep for group in per_prompt.values()):
            return self._choices
        return [
            choice
            for group in per_prompt.values()
            for choice in sorted(group, key=lambda c: -c.cumulative_logprob)[:keep]
        ]

    def _legacy(self, choice: _Choice) -> LegacyLogprobs:
        if choice.legacy is None:
            choice.legacy = LegacyLogprobs(self._texts)
        return choice.legacy

    def _whole_logprobs(self, choice: _Choice) -> dict[str, Any] | None:
        if not self.options.logprobs:
            return None
        if self.fmt.chat:
            return chat_logprobs(choice.chat_all, self._texts)
        return self._legacy(choice).whole()

    def _delta_logprobs(self, choice: _Choice) -> dict[str, Any] | None:
        if not self.options.logprobs:
            return None
        if self.fmt.chat:
            entries, choice.chat = choice.chat, []
            return chat_logprobs(entries, self._texts) if entries else None
        return self._legacy(choice).take()

    def _usage(self) -> dict[str, Any]:
        """Prompt tokens once per prompt, completion tokens of every choice."""
        firsts = [c.last for c in self._choices if c.plan.fork_of is None]
        return usage(
            sum(o.prompt_tokens for o in firsts),
            sum(c.last.completion_tokens for c in self._choices),
            sum(o.num_cached_tokens for o in firsts),
        )

    def _sse(
        self, choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None
    ) -> bytes:
        body = self.fmt.chunk(self.request_id, self.model, self.created, choices)
        if self.options.include_usage:
            body["usage"] = usage_body
        return b"data: " + orjson.dumps(body) + b"\n\n"


class _AfterFirstTokensResponse(Response):
    """A non-streamed answer whose headers leave once prefill is over and whose body
    follows when generation ends; the client leaving meanwhile aborts the generation."""

    media_type = "application/json"

    def __init__(self, generation: Generation, outputs: AsyncIterator[tuple[int, Any]]) -> None:
        self.status_code = 200
        self.background = None
        self._generation = generation
        self._outputs = outputs
        self.init_headers({FIRST_TOKEN_HEADER: "1"})  # no body yet: no content-length

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        generation = self._generation
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                done = await _unless_disconnected(receive, generation._take_rest(self._outputs))
            except RequestAborted as exc:
                body = APIError(503, f"Request aborted: {exc}").body()
            else:
                if done is None:
                    return  # the client is gone
                failed = generation._any_grammar_failed()
                body = _grammar_failed().body() if failed else generation._body()
        finally:
            generation._abort_unfinished()
        await send({"type": "http.response.body", "body": orjson.dumps(body)})


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
