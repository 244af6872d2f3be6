"""The engine requests behind one HTTP request's choices, and their merged outputs.

A request with ``n`` choices per prompt, or a list of prompts, is one engine request per
choice. The ``n`` choices of one prompt are forked sequences over the prompt's KV blocks,
not ``n`` prefills: the first choice of each prompt is added at once, and its siblings only
when its first output arrives. By then its prompt's full blocks are committed to the prefix
cache and pinned by it, so each sibling matches them (one more pin on the same blocks:
the ledger allocates the prompt once) and computes, into a block of its own, only the
block holding the prompt's last token (at most ``block_size`` tokens), whose logits it
needs to sample.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvserve.core.sampling_params import SamplingParams
from kvserve.worker.generation_backend import GenerationBackend, OutputStream


@dataclass(frozen=True, slots=True)
class ChoicePlan:
    """One choice to generate: its index in the response, its prompt and rules."""

    index: int
    prompt_index: int
    prompt: str | list[int]
    params: SamplingParams
    fork_of: int | None = None  # the choice whose first output it waits for


class ChoiceSet:
    """Adds the choices' engine requests and merges their outputs in arrival order.

    Whatever ends the iteration (the last output, an error, a cancellation) leaves no
    request behind: :meth:`abort_unfinished` aborts every added request not finished.
    """

    def __init__(self, backend: GenerationBackend, request_id: str, plans: list[ChoicePlan]):
        self._backend = backend
        self._request_id = request_id
        self._plans = plans
        self._streams: dict[int, OutputStream] = {}
        self._forks: dict[int, list[ChoicePlan]] = {}
        for plan in plans:
            if plan.fork_of is not None:
                self._forks.setdefault(plan.fork_of, []).append(plan)

    def engine_request_id(self, index: int) -> str:
        return self._request_id if index == 0 else f"{self._request_id}-{index}"

    async def start(self) -> None:
        """Adds every choice that waits for no other; raises what the engine refuses
        (e.g. a prompt longer than the context), with nothing left running."""
        try:
            for plan in self._plans:
                if plan.fork_of is None:
                    await self._add(plan)
        except BaseException:
            self.abort_unfinished()
            raise

    async def _add(self, plan: ChoicePlan) -> None:
        request_id = self.engine_request_id(plan.index)
        self._streams[plan.index] = await self._backend.generate(
            request_id, plan.prompt, plan.params
        )

    async def outputs(self) -> AsyncIterator[tuple[int, Any]]:
        """``(choice index, output)`` until every choice has finished; a failed request
        raises its error (``RequestAborted``)."""
        if len(self._plans) == 1:  # the common case: no task and queue per request
            async for output in self._streams[0]:
                yield 0, output
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        pumps = [self._pump(index, stream, queue) for index, stream in self._streams.items()]
        unfinished = len(self._plans)
        try:
            while unfinished:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                forks = self._forks.pop(index, ())
                if forks:  # added together: one command batch, admitted in one step
                    await asyncio.gather(*(self._add(plan) for plan in forks))
                    pumps += [self._pump(p.index, self._streams[p.index], queue) for p in forks]
                if item.finished:
                    unfinished -= 1
                yield index, item
        finally:
            for pump in pumps:
                pump.cancel()

    @staticmethod
    def _pump(
        index: int, stream: OutputStream, queue: asyncio.Queue[tuple[int, Any]]
    ) -> asyncio.Task[None]:
        async def pump() -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as exc:
                queue.put_nowait((index, exc))

        return asyncio.ensure_future(pump())

    def abort_unfinished(self) -> list[int]:
        """Aborts every added request that has not finished; returns their choices.
        Each is aborted once: a second call finds nothing more to abort."""
        aborted = [index for index, stream in self._streams.items() if not stream.finished]
        for index in aborted:
            self._backend.abort(self.engine_request_id(index))
            del self._streams[index]
        return aborted
