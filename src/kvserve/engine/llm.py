"""Offline batch generation in the shape vLLM users know::

    from kvserve import LLM, SamplingParams
    llm = LLM("path/to/model", max_num_batched_tokens=256)
    for result in llm.generate(["Hello", "The sea"], SamplingParams(temperature=0)):
        print(result.text, result.num_cached_tokens)

All prompts of one call are queued at once and run with continuous batching; a prompt
that shares a prefix with an earlier one (in this call or a previous one) reuses its KV.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard, cast

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import GenerationResult
from kvserve.model_folder.chat_template import ChatTemplateError
from kvserve.model_folder.tokenizer import Tokenizer

Prompt = str | list[int]
Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | Path, **engine_options: Any) -> None:
        """``engine_options`` are :class:`LLMEngine`'s keyword arguments."""
        # Results carry only whole texts, so the engine need not detokenize every step.
        self.engine = LLMEngine(model, **{"stream_text": False, **engine_options})
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """One result per prompt, in order. A prompt is text or a list of token ids.

        A request the engine refuses (prompt longer than the context, empty prompt) gets
        a result with ``error`` set; the others run normally.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompt_list))
        tokenizer = self.engine.tokenizer
        results = [
            GenerationResult(p, tokenizer.encode(p) if isinstance(p, str) else p)
            for p in prompt_list
        ]
        return self._run(list(zip(results, params, strict=True)))

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **template_kwargs: Any,
    ) -> list[GenerationResult]:
        """Generate the assistant's next turn for each conversation.

        The model's chat template renders the prompt (with the generation prompt); a
        conversation the template refuses gets a result with ``error`` set.
        """
        conversations: list[Conversation] = (
            [messages]
            if _is_conversation(messages)
            else list(cast(Sequence[Conversation], messages))
        )
        params = _params_per_prompt(sampling_params, len(conversations))
        jobs: list[tuple[GenerationResult, SamplingParams]] = []
        for conversation, request_params in zip(conversations, params, strict=True):
            try:
                token_ids = self.engine.tokenizer.encode_chat(conversation, **template_kwargs)
            except ChatTemplateError as err:
                jobs.append((_failed(GenerationResult([], []), str(err)), request_params))
                continue
            jobs.append((GenerationResult(token_ids, token_ids), request_params))
        return self._run(jobs)

    def _run(self, jobs: list[tuple[GenerationResult, SamplingParams]]) -> list[GenerationResult]:
        engine = self.engine
        pending: dict[str, GenerationResult] = {}
        try:
            for result, params in jobs:
                if result.error is not None:
                    continue
                request_id = f"llm-{next(self._ids)}"
                try:
                    engine.add_request(request_id, result.prompt_token_ids, params)
                except InvalidRequestError as err:
                    _failed(result, str(err))
                    continue
                pending[request_id] = result
            while pending:
                for output in engine.step():
                    result = pending[output.request_id]
                    result.text += output.new_text
                    result.token_ids += output.new_token_ids
                    if output.finished:
                        result.num_cached_tokens = output.num_cached_tokens
                        result.finish_reason = output.finish_reason
                        del pending[output.request_id]
        finally:
            # Interrupted (Ctrl-C, a model error): release every block this call holds.
            for request_id in pending:
                engine.abort_request(request_id)
        return [result for result, _ in jobs]


def _failed(result: GenerationResult, message: str) -> GenerationResult:
    result.error = message
    result.finish_reason = "error"
    return result


def _is_token_list(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or _is_token_list(prompts):
        return [prompts]
    return [p if isinstance(p, str) else list(p) for p in cast(Sequence[Prompt], prompts)]


def _is_conversation(value: object) -> TypeGuard[Conversation]:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)
