"""The OpenAI endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Each handler turns a validated body into a prompt and :class:`SamplingParams`, then hands
both to :class:`Generation`. Everything the client can get wrong is reported here as a
400 naming the parameter, before the engine thread sees the request.

The two generation routes are declared on the FastAPI app (they are in its OpenAPI
schema, which clients and the fuzz tests read) but served by :class:`GenerationRoutes`,
plain ASGI in front of FastAPI's routing: FastAPI's per-request route matching,
dependency solving and body parsing cost several times what the worker itself does for a
short generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.core.sampling_params import InvalidParameterError, SamplingParams
from kvserve.core.structured_output import StructuredOutput
from kvserve.model_folder.chat_template import ChatTemplateError
from kvserve.worker.choices import ChoicePlan
from kvserve.worker.errors import (
    APIError,
    internal_error,
    invalid_request,
    validation_error_to_api_error,
)
from kvserve.worker.generation import Generation, ResponseOptions
from kvserve.worker.generation_backend import GenerationBackend
from kvserve.worker.json_response import JSONResponse
from kvserve.worker.logprob_format import TokenTexts
from kvserve.worker.metrics import WorkerMetrics
from kvserve.worker.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from kvserve.worker.response_format import structured_output
from kvserve.worker.responses import CHAT, COMPLETION, ResponseFormat
from kvserve.worker.tool_calls import plan_tools


class OpenAIEndpoints:
    """Request handling shared by the OpenAI routes of one worker.

    ``single_choice``: the backend serves one engine request per HTTP request (a PD
    session), so ``n > 1`` and lists of prompts are refused with a 400.
    """

    def __init__(
        self, backend: GenerationBackend, metrics: WorkerMetrics, *, single_choice: bool = False
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.model_name: str = backend.engine.model_name
        self.created = int(time.time())
        self.single_choice = single_choice
        self.token_texts = TokenTexts(backend.engine.tokenizer)

    def check_request(self, body: SamplingRequest) -> None:
        """The model is this worker's, and every field set is one the worker honours."""
        if body.model != self.model_name:
            raise APIError(
                404,
                f"The model {body.model!r} does not exist; this worker serves {self.model_name!r}.",
                param="model",
                code="model_not_found",
            )
        refusal = body.unhonoured()
        if refusal is not None:
            field, why = refusal
            raise APIError(400, why, param=field, code="unsupported_parameter")

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "kvserve",
                    "max_model_len": self.backend.engine.max_model_len,
                }
            ],
        }

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages, tools = body.template_input()
        try:
            token_ids: list[int] = self.backend.engine.tokenizer.encode_chat(messages, tools=tools)
            return token_ids
        except (ChatTemplateError, jinja2.TemplateError) as exc:
            # A template may refuse a conversation (e.g. roles that do not alternate).
            raise invalid_request(f"messages: {exc}", param="messages") from exc

    async def completion(self, request: Request, body: CompletionRequest) -> Response:
        self.check_request(body)
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        prompts = body.prompts()
        # echo with logprobs scores the prompt; max_tokens 0 (echo only) computes just that
        prompt_logprobs = body.logprobs if body.echo else None
        if max_tokens == 0:
            prompt_logprobs = body.logprobs or 0
        echo_texts = [self._prompt_text(p) for p in prompts] if body.echo else None
        options = ResponseOptions(
            echo_texts, body.logprobs is not None, _stream_usage(body), keep_best=body.n
        )
        samples = body.samples_per_prompt()
        # best_of ranks by the sampled tokens' logprobs: computed even if not returned
        logprobs = body.logprobs if samples == body.n else (body.logprobs or 0)
        base = _sampling_params(
            body, max_tokens, logprobs, prompt_logprobs, structured_output(body.response_format)
        )
        plans = self._plans(body, prompts, base, samples)
        return await self._generate(request, body, COMPLETION, plans, options)

    async def chat_completion(self, request: Request, body: ChatCompletionRequest) -> Response:
        self.check_request(body)
        tools = plan_tools(
            body.tools,
            body.tool_choice,
            body.parallel_tool_calls,
            self.backend.engine.tokenizer.chat_template,
        )
        structured = structured_output(body.response_format)
        if tools is not None and tools.structured is not None:
            if structured is not None:
                raise invalid_request(
                    "response_format cannot be combined with a forced tool call",
                    param="response_format",
                )
            structured = tools.structured
        prompt = self.chat_prompt(body)
        logprobs = body.num_logprobs()
        options = ResponseOptions(None, logprobs is not None, _stream_usage(body), tools=tools)
        base = _sampling_params(body, body.requested_max_tokens(), logprobs, None, structured)
        plans = self._plans(body, [prompt], base, body.n)
        return await self._generate(request, body, CHAT, plans, options)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        text: str = self.backend.engine.tokenizer.decode(prompt)
        return text

    def _plans(
        self,
        body: SamplingRequest,
        prompts: Sequence[str | list[int]],
        base: SamplingParams,
        samples: int,
    ) -> list[ChoicePlan]:
        """``samples`` choices per prompt, indexed prompt by prompt. Choice ``i`` of a
        prompt has seed ``seed + i``: reproducible, and the same for a prompt sent alone
        or in a list. Choices after the first fork from its prompt blocks. Each choice is
        its own engine request, so a structured output gets a grammar matcher per choice."""
        if self.single_choice and len(prompts) * samples > 1:
            param = "n" if body.n > 1 else "prompt"
            raise invalid_request(f"{param}: one choice per request on this route", param=param)
        forks = base.max_tokens != 0  # echo only: nothing to share but the prompt
        plans = []
        for prompt_index, prompt in enumerate(prompts):
            first = prompt_index * samples
            for sample in range(samples):
                params = base
                fork_of = None
                if sample > 0:
                    seed = None if base.seed is None else base.seed + sample
                    params = dataclasses.replace(
                        base, seed=seed, prompt_logprobs=None if forks else base.prompt_logprobs
                    )
                    fork_of = first if forks else None
                plans.append(ChoicePlan(first + sample, prompt_index, prompt, params, fork_of))
        return plans

    async def _generate(
        self,
        request: Request,
        body: SamplingRequest,
        fmt: ResponseFormat,
        plans: list[ChoicePlan],
        options: ResponseOptions,
    ) -> Response:
        if plans[0].params.structured_output is not None:
            # the grammar library's tokenizer is built once, here, not on the engine thread
            await asyncio.to_thread(self.backend.engine.grammars.prepare)
        generation = Generation(
            self.backend, self.metrics, fmt, self.model_name, plans, options, self.token_texts
        )
        try:
            return await generation.respond(request, stream=body.stream)
        except InvalidParameterError as exc:
            raise invalid_request(str(exc), param=exc.param) from exc


def _stream_usage(body: SamplingRequest) -> bool:
    return body.stream and body.include_usage_in_stream()


def _sampling_params(
    body: SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    structured: StructuredOutput | None,
) -> SamplingParams:
    fields: dict[str, Any] = {
        "structured_output": structured,
        "max_tokens": max_tokens,
        "top_k": body.top_k if body.top_k is not None else 0,
        "seed": body.seed,
        "stop": body.stop_strings(),
        "ignore_eos": body.ignore_eos,
        "min_tokens": body.min_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }
    if body.temperature is not None:
        fields["temperature"] = body.temperature
    if body.top_p is not None:
        fields["top_p"] = body.top_p
    try:
        return SamplingParams(**fields)
    except InvalidParameterError as exc:
        raise invalid_request(str(exc), param=exc.param) from exc


def build_openai_router(endpoints: OpenAIEndpoints) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def list_models() -> Response:
        return JSONResponse(endpoints.models())

    router.post("/completions", name="create_completion")(endpoints.completion)
    router.post("/chat/completions", name="create_chat_completion")(endpoints.chat_completion)
    return router


class GenerationRoutes:
    """ASGI middleware serving ``POST /v1/completions`` and ``/v1/chat/completions`` as
    the FastAPI routes would (the body validated strictly in one pydantic
    call, errors as OpenAI bodies), and passing every other request on to ``app``."""

    def __init__(self, app: ASGIApp, endpoints: OpenAIEndpoints) -> None:
        self.app = app
        self._endpoints = endpoints
        self._routes: dict[str, tuple[type[SamplingRequest], Any]] = {
            "/v1/completions": (CompletionRequest, endpoints.completion),
            "/v1/chat/completions": (ChatCompletionRequest, endpoints.chat_completion),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self._routes.get(scope["path"])
        if route is None:
            await self.app(scope, receive, send)
            return
        body_type, handler = route
        request = Request(scope, receive)
        try:
            body = _parse_body(body_type, await request.body(), request.headers.get("content-type"))
            response = await handler(request, body)
        except APIError as exc:
            response = exc.response()
        except Exception as exc:  # FastAPI's own handlers are behind this layer
            response = internal_error(exc)
        await response(scope, receive, send)


def _parse_body(body_type: type[BaseModel], raw: bytes, content_type: str | None) -> Any:
    """As FastAPI reads a JSON body: a body declared as another media type is not JSON."""
    if content_type is not None and not _is_json_media_type(content_type):
        raise invalid_request(f"Invalid request body: expected JSON, got {content_type!r}.")
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        raise validation_error_to_api_error(errors) from exc


def _is_json_media_type(content_type: str) -> bool:
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )
