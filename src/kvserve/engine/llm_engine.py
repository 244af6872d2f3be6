"""The engine loop: scheduler + KV cache + model runner + sampler, one step at a time.

Each :meth:`LLMEngine.step` asks the scheduler what to compute, runs it in one forward,
samples a token for every sequence whose pending tokens are all computed, applies the
stop rules, and returns per-request deltas. Callers (the worker's engine thread, the
offline :class:`~kvserve.engine.llm.LLM`) drive it; it starts no thread of its own.
KV tiers and prefill/decode disaggregation are KV connectors
(:mod:`kvserve.engine.kv_connector`) handed to it at construction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvserve.core.hashing import make_namespace, salted
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_connector import SchedulerConnectors
from kvserve.core.kv_events import EventLog
from kvserve.core.request import Request
from kvserve.core.sampling_params import InvalidParameterError, SamplingParams
from kvserve.core.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from kvserve.core.stop_checker import find_stop_string, stop_holdback, token_finish_reason
from kvserve.engine.cost_model_runner import CostModelRunner
from kvserve.engine.device import parse_dtype, pick_device, pick_dtype
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.kv_block_io import KVBlockLayout
from kvserve.engine.kv_connector import (
    ConnectorContext,
    ConnectorFactory,
    KVConnector,
    QueueView,
    TierBlocks,
)
from kvserve.engine.kv_pool import KVPool
from kvserve.engine.logprobs import TokenLogprob, log_softmax, token_logprobs
from kvserve.engine.model_runner import ModelRunner, SequenceBatchItem
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampler import Sampler, SamplingRow, seeded_generator
from kvserve.engine.structured_output import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    unpack_bitmask,
)
from kvserve.model_folder.config import ModelConfig
from kvserve.model_folder.tokenizer import IncrementalDetokenizer, Tokenizer

DEFAULT_KV_CACHE_MEMORY = 1 << 30

logger = logging.getLogger(__name__)

C = TypeVar("C", bound=KVConnector)


@dataclass(slots=True)
class _Generation:
    """Engine-side state of one request: what the pure scheduler must not hold."""

    request: Request
    detokenizer: IncrementalDetokenizer
    sampling: SamplingRow  # how its tokens are chosen once min_tokens are out
    holdback: int  # trailing characters that may still turn into a stop string
    text: str = ""  # output text so far, stop string cut
    num_sent_chars: int = 0  # of ``text``
    grammar: GrammarMatcher | None = None  # structured output: what may come next
    # Prompt logprobs as the prompt's chunks are computed; handed out with the first output.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_done: bool = True

    def wants_prompt_logits(self, chunk: ScheduledChunk) -> bool:
        """The chunk covers a prompt position whose next token's logprob is still due."""
        return not self.prompt_logprobs_done and chunk.start < chunk.request.num_prompt_tokens - 1

    def stream_cut(self, finished: bool) -> str:
        """The text not sent yet that can be sent now."""
        end = len(self.text) if finished else len(self.text) - self.holdback
        if end <= self.num_sent_chars:
            return ""
        delta = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta


def _build_connectors(
    factories: Sequence[ConnectorFactory], context: ConnectorContext
) -> tuple[KVConnector, ...]:
    """Every connector, or none: if one cannot be built, those built before are closed."""
    built: list[KVConnector] = []
    try:
        for make in factories:
            built.append(make(context))
    except BaseException:
        for connector in built:
            connector.close()
        raise
    return tuple(built)


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 256,
        device: str | None = None,
        dtype: str | None = None,  # float32 | bfloat16 | float16; "auto" or None: by device
        model_name: str | None = None,
        seed: int | None = None,
        runner: CostModelRunner | None = None,  # stands in for the model (no weights)
        connectors: Sequence[ConnectorFactory] = (),  # KV tiers, PD export or import
        stream_text: bool = True,  # False: text only in a request's last output
    ) -> None:
        config = ModelConfig.from_dir(model_dir)
        if num_blocks is None:
            kv_dtype = pick_dtype(config, pick_device(device), parse_dtype(dtype))
            memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
            num_blocks = ModelRunner.blocks_for_memory(config, block_size, memory, kv_dtype)
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.model_name = model_name or Path(model_dir).name
        kv_pool: KVPool | None = None
        layout: KVBlockLayout | None = None
        self.runner: ModelRunner | CostModelRunner
        if runner is None:
            model_runner = ModelRunner(
                model_dir,
                num_blocks=num_blocks,
                block_size=block_size,
                device=device,
                dtype=parse_dtype(dtype),
            )
            kv_pool = model_runner.kv_pool
            layout = KVBlockLayout.of_runner(model_runner, self.model_name)
            self.runner = model_runner
        else:
            self.runner = runner
        self.tokenizer = Tokenizer(model_dir)
        self.namespace = make_namespace(self.model_name)
        # A sequence longer than the pool could never run, even alone.
        self.max_model_len = min(config.max_position_embeddings, num_blocks * block_size)
        self.eos_token_ids = self.tokenizer.eos_token_ids | set(config.eos_token_ids)
        self.events = EventLog()
        self.kv_cache = KVCacheManager(num_blocks, block_size, events=self.events)
        context = ConnectorContext(
            self.kv_cache, self.events, self.namespace, self.max_model_len, kv_pool, layout
        )
        self.connectors = _build_connectors(connectors, context)
        self.scheduler = Scheduler(
            self.kv_cache,
            SchedulerConfig(max_num_batched_tokens, max_num_seqs),
            SchedulerConnectors(self.connectors) if self.connectors else None,
        )
        self.sampler = Sampler(self.runner.device, seed)
        self.grammars = GrammarCompiler(self.tokenizer, config.vocab_size, self.eos_token_ids)
        # Offline callers read only the final text: detokenizing once per request instead
        # of once per token saves two tokenizer calls per token (stop strings still need
        # the text every step).
        self._stream_text = stream_text
        self._generations: dict[str, _Generation] = {}

    # -- requests ------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request, or raise :class:`InvalidRequestError` and change nothing."""
        try:
            params.validate()
        except InvalidParameterError as err:
            raise InvalidRequestError(err.param, str(err)) from None
        if request_id in self._generations:
            raise InvalidRequestError("request_id", f"request id {request_id!r} is in use")
        vocab_size = self.runner.config.vocab_size
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids", f"stop_token_ids must be below the vocabulary size {vocab_size}"
            )
        token_ids = self.prompt_token_ids(prompt)
        room = self.max_model_len - len(token_ids)
        if room < (0 if params.max_tokens == 0 else 1):
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {len(token_ids)} tokens, but the context holds "
                f"{self.max_model_len} and at least one must be generated",
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        grammar = None
        if params.structured_output is not None:
            grammar = self.grammars.matcher(params.structured_output)
        request = Request(
            request_id,
            token_ids,
            params,
            max_tokens=max_tokens,
            namespace=salted(self.namespace, params.cache_salt),
            block_size=self.kv_cache.block_size,
        )
        generator = (
            None if params.seed is None else seeded_generator(params.seed, self.runner.device)
        )
        generation = _Generation(
            request,
            self.tokenizer.detokenizer(token_ids),
            SamplingRow(params, generator),
            stop_holdback(params.stop),
            grammar=grammar,
        )
        if params.prompt_logprobs is not None:
            generation.prompt_logprobs = [None] * len(token_ids)
            generation.prompt_logprobs_done = len(token_ids) == 1
            request.reuse_prefix = generation.prompt_logprobs_done
        self.scheduler.add(request)
        self._generations[request_id] = generation

    def prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, or :class:`InvalidRequestError` (empty, out of vocabulary)."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        vocab_size = self.runner.config.vocab_size
        bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
        if bad is not None:
            raise InvalidRequestError(
                "prompt", f"token id {bad!r} is outside the vocabulary [0, {vocab_size})"
            )
        return token_ids

    def abort_request(self, request_id: str) -> None:
        """Drop the request and free its blocks now; unknown or finished ids are ignored."""
        self.scheduler.abort(request_id)
        self._generations.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def load(self) -> dict[str, Any]:
        kv = self.kv_cache
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_blocks": kv.num_free_blocks,
            "cached_blocks": kv.num_cached_blocks,
            "evictable_blocks": kv.num_evictable_blocks,
            "total_blocks": kv.num_blocks,
            "prefill_tokens": self.scheduler.num_prefill_tokens,
            "preemptions": self.scheduler.stats.preemptions,
        }

    # -- connectors ----------------------------------------------------------------

    def connector(self, kind: type[C]) -> C:
        """The connector of type ``kind`` this engine was built with (``LookupError``)."""
        for connector in self.connectors:
            if isinstance(connector, kind):
                return connector
        raise LookupError(f"this engine has no {kind.__name__}")

    def connector_metrics(self) -> dict[str, int]:
        return {name: value for c in self.connectors for name, value in c.metrics().items()}

    def connector_snapshot(self) -> dict[str, TierBlocks]:
        """The tiers below the device, as the connectors' events describe them."""
        return {tier: blocks for c in self.connectors for tier, blocks in c.snapshot().items()}

    def shared_store(self) -> str | None:
        """The KV store this engine's storage tier shares with other workers, by name."""
        return next((s for c in self.connectors if (s := c.shared_store()) is not None), None)

    def check(self) -> None:
        """The KV cache's invariants and every connector's."""
        self.kv_cache.check()
        for connector in self.connectors:
            connector.check()

    def close(self) -> None:
        """Stop the connectors' threads (queued storage writes finish first, briefly)."""
        for connector in self.connectors:
            connector.close()

    # -- one step ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        try:
            outputs, dropped = self._step()
        except Exception as exc:
            for request_id in [r for c in self.connectors for r in c.step_failed(exc)]:
                self.abort_request(request_id)
            raise
        if dropped:
            outputs = [o for o in outputs if o.request_id not in dropped]
            for request_id in dropped:
                self.abort_request(request_id)
        return outputs

    def _step(self) -> tuple[list[RequestOutput], set[str]]:
        """The step's outputs, and the requests connectors are done with."""
        connectors = self.connectors
        if connectors:
            queues = QueueView(self.scheduler.running, self.scheduler.waiting)
            for connector in connectors:
                connector.before_step(queues)
        plan = self.scheduler.schedule()
        outputs = [self._finish(r, r.finish_reason or "length") for r in plan.finished_before_run]
        if not plan.chunks:
            return outputs, set()
        items = [self._batch_item(chunk) for chunk in plan.chunks]
        logits = self.runner.forward(items)
        self.scheduler.advance(plan)
        dropped = {r for c in connectors for r in c.after_step(plan)}
        last_rows = self._last_rows(plan.chunks, items, logits)
        rows = [i for i, chunk in enumerate(plan.chunks) if chunk.completes_sequence]
        done = {i for i in rows if plan.chunks[i].request.max_tokens == 0}
        if done:  # echo with max_tokens 0: the prompt is computed, nothing is generated
            rows = [i for i in rows if i not in done]
            outputs.extend(self._finish(plan.chunks[i].request, "length") for i in sorted(done))
        if not rows:
            return outputs, dropped
        generations = [self._generations[plan.chunks[i].request.request_id] for i in rows]
        if last_rows is not None:
            sampled = logits[[last_rows[i] for i in rows]]
        elif len(rows) == len(plan.chunks):
            sampled = logits
        else:
            sampled = logits[rows]
        samplings = [self._sampling_row(g) for g in generations]
        failed = self._apply_grammars(generations, samplings, sampled.shape[1])
        # The sampler masks ``sampled`` in place (grammar, suppressed tokens): logprobs are
        # taken from the raw logits first, so a masked token never reads as -inf.
        wanted = [j for j, g in enumerate(generations) if g.request.params.logprobs is not None]
        row_logprobs = log_softmax(sampled[wanted]) if wanted else None
        tokens = self.sampler.sample(sampled, samplings)
        chosen: dict[int, TokenLogprob] = {}
        if row_logprobs is not None:
            for row, j in enumerate(wanted):
                num_top = generations[j].request.params.logprobs or 0
                chosen[j] = token_logprobs(row_logprobs[row : row + 1], [tokens[j]], num_top)[0]
        for j, (generation, token) in enumerate(zip(generations, tokens, strict=True)):
            if j in failed:
                outputs.append(self._finish(generation.request, "error"))
            else:
                outputs.append(self._append_token(generation, token, chosen.get(j)))
        return outputs, dropped

    def _last_rows(
        self, chunks: list[ScheduledChunk], items: list[SequenceBatchItem], logits: torch.Tensor
    ) -> list[int] | None:
        """Each chunk's row of its last token in ``logits``; None when that is the chunk's
        own index (no item asked for all its logits). Records prompt logprobs on the way."""
        if not any(item.all_logits for item in items):
            return None
        last_rows: list[int] = []
        row = 0
        for chunk, item in zip(chunks, items, strict=True):
            if item.all_logits:
                self._record_prompt_logprobs(chunk, logits[row : row + chunk.num_tokens])
                row += chunk.num_tokens
            else:
                row += 1
            last_rows.append(row - 1)
        return last_rows

    def _record_prompt_logprobs(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Position ``p``'s logits score prompt token ``p + 1``."""
        request = chunk.request
        generation = self._generations[request.request_id]
        assert generation.prompt_logprobs is not None, "all_logits only for prompt logprobs"
        count = min(chunk.num_tokens, request.num_prompt_tokens - 1 - chunk.start)
        first = chunk.start + 1
        targets = request.token_ids[first : first + count]
        num_top = request.params.prompt_logprobs or 0
        found = token_logprobs(log_softmax(logits[:count]), targets, num_top)
        generation.prompt_logprobs[first : first + count] = found
        if first + count == request.num_prompt_tokens:
            generation.prompt_logprobs_done = True
            request.reuse_prefix = True  # a preempted request may now resume from cache

    def _apply_grammars(
        self, generations: list[_Generation], samplings: list[SamplingRow], vocab_size: int
    ) -> set[int]:
        """Gives every constrained row its grammar's mask of allowed tokens; returns the
        rows whose grammar failed (they end with ``"error"``, the rest of the batch goes
        on)."""
        constrained = [i for i, g in enumerate(generations) if g.grammar is not None]
        if not constrained:
            return set()
        bitmask = self.grammars.new_bitmask(len(constrained))
        failed: set[int] = set()
        for row, i in enumerate(constrained):
            grammar = generations[i].grammar
            assert grammar is not None
            try:
                grammar.fill_bitmask(bitmask, row)
            except GrammarError as err:
                self._grammar_failed(generations[i], err)
                failed.add(i)
        masks = unpack_bitmask(bitmask, vocab_size).to(self.runner.device)
        for row, i in enumerate(constrained):
            if i in failed:
                continue  # sampled unconstrained, its token dropped
            if not masks[row].any():
                self._grammar_failed(generations[i], GrammarError("no token is allowed"))
                failed.add(i)
                continue
            samplings[i] = replace(samplings[i], allowed_tokens=masks[row])
        return failed

    @staticmethod
    def _grammar_failed(generation: _Generation, error: GrammarError) -> None:
        logger.error("structured output of %s failed: %s", generation.request.request_id, error)

    def _batch_item(self, chunk: ScheduledChunk) -> SequenceBatchItem:
        request = chunk.request
        return SequenceBatchItem(
            token_ids=request.token_ids[chunk.start : chunk.start + chunk.num_tokens],
            start_pos=chunk.start,
            block_table=self.kv_cache.block_table(request.request_id),
            sequence_key=request,  # this object, not its id: a later request may reuse an id
            all_logits=self._generations[request.request_id].wants_prompt_logits(chunk),
        )

    def _sampling_row(self, generation: _Generation) -> SamplingRow:
        """The request's own row, or below ``min_tokens`` one that masks its stop tokens."""
        request = generation.request
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            return generation.sampling
        eos = () if params.ignore_eos else tuple(self.eos_token_ids)
        return SamplingRow(params, generation.sampling.generator, (*params.stop_token_ids, *eos))

    def _append_token(
        self, generation: _Generation, token: int, logprob: TokenLogprob | None
    ) -> RequestOutput:
        request = generation.request
        if generation.grammar is not None:
            try:
                generation.grammar.accept(token)
            except GrammarError as err:
                self._grammar_failed(generation, err)
                return self._finish(request, "error")
        request.token_ids.append(token)
        reason = token_finish_reason(request, self.eos_token_ids)
        if reason is None and generation.grammar is not None and generation.grammar.finished:
            reason = "stop"  # complete, even where end of text is ignored (ignore_eos)
        stops = request.params.stop
        new_text = ""
        if self._stream_text or stops:
            new_text = generation.detokenizer.push([token])
        elif reason is not None:
            new_text = generation.detokenizer.push(request.output_token_ids)
        if reason is not None:
            new_text += generation.detokenizer.finish()
        generation.text += new_text
        if stops and request.num_output_tokens >= request.params.min_tokens:
            cut = find_stop_string(generation.text, stops, len(new_text))
            if cut is not None:
                generation.text = generation.text[:cut]
                reason = "stop"
        logprobs = None if logprob is None else [logprob]
        if reason is None:
            return self._output(generation, [token], finished=False, logprobs=logprobs)
        return self._finish(request, reason, [token], logprobs)

    def _finish(
        self,
        request: Request,
        reason: str,
        new_token_ids: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        self.scheduler.finish(request, reason)
        generation = self._generations.pop(request.request_id)
        return self._output(generation, new_token_ids or [], finished=True, logprobs=logprobs)

    def _output(
        self,
        generation: _Generation,
        new_token_ids: list[int],
        *,
        finished: bool,
        logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        request = generation.request
        prompt_logprobs = generation.prompt_logprobs
        if prompt_logprobs is not None and generation.prompt_logprobs_done:
            generation.prompt_logprobs = None  # sent once, with the first output
        else:
            prompt_logprobs = None
        if request.params.logprobs is not None and logprobs is None:
            logprobs = []
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_text=generation.stream_cut(finished),
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            completion_tokens=request.num_output_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=None if prompt_logprobs is None else request.prompt_token_ids,
        )
