"""JSON-schema grammars for one model's tokenizer, and the per-sequence matcher.

llguidance does the work: it reads the tokenizer's vocabulary and byte encoding from its
``tokenizer.json``, compiles a JSON schema into a grammar, and for each sequence tells
which tokens may come next. It was chosen by measurement (``benchmarks/
structured_mask_cost.py``, docs/benchmarks.md): the only library whose output fitted all
50 random test schemas; its mask costs tens of microseconds a token on CPU.

Output is compact JSON (no free whitespace between tokens): a model with random weights
would otherwise spend its whole budget on blanks.

``llguidance.torch`` is not imported: it decorates a kernel with ``torch.compile`` at
import, which loads TorchDynamo (seconds at every worker start); the matcher's own call
that writes a mask into memory is all that is needed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import llguidance
import torch

from kvserve.core.structured_output import StructuredOutput
from kvserve.engine.errors import InvalidRequestError
from kvserve.model_folder.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(RuntimeError):
    """The grammar library failed on a running sequence (a bug or a limit hit)."""


class GrammarMatcher:
    """Where one sequence stands in its grammar: the tokens allowed next, advanced by
    each token the sequence accepts. Whatever the library raises or reports becomes a
    :class:`GrammarError`, which ends this sequence alone, never the engine's step."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (one bit per token id)."""
        words = bitmask[row]  # int32 on the CPU, from GrammarCompiler.new_bitmask
        try:
            # writes the row in place, without the GIL
            self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        except Exception as err:  # any library fault is this sequence's, not the batch's
            raise GrammarError(f"mask failed: {err}") from err
        self._raise_if_failed()

    def accept(self, token_id: int) -> None:
        """Advances past ``token_id``; :class:`GrammarError` if the grammar refuses it."""
        try:
            accepted = self._matcher.consume_token(token_id)
        except Exception as err:  # as in fill_bitmask
            raise GrammarError(f"advance failed: {err}") from err
        if not accepted:
            self._raise_if_failed()
            raise GrammarError(f"token {token_id} is not allowed by the grammar")

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits no further token (not even end of text)."""
        return bool(self._matcher.is_stopped())

    def _raise_if_failed(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())


class GrammarCompiler:
    """Builds matchers for one tokenizer. The tokenizer's grammar-side form is built at
    the first structured request, so a worker that never sees one never pays for it; the
    worker calls :meth:`prepare` off the engine thread first (0.1–1 s for a large
    vocabulary), so that the engine's steps never wait for it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)  # the logits' width
        self._eos = sorted(eos_token_ids)
        self._limits = limits
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._building = threading.Lock()

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for ``spec``, or :class:`InvalidRequestError` naming the field
        the schema came from when the library refuses it."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                spec.json_schema, defaults=_JSON_DEFAULTS
            )
        except (ValueError, TypeError) as err:  # not JSON, or not a schema object
            raise InvalidRequestError(spec.param, f"invalid JSON schema: {err}") from None
        try:
            matcher = llguidance.LLMatcher(self._lltokenizer(), grammar, limits=self._limits)
        except ValueError as err:
            raise InvalidRequestError(spec.param, f"invalid JSON schema: {err}") from None
        if matcher.is_error():
            raise InvalidRequestError(spec.param, f"invalid JSON schema: {matcher.get_error()}")
        return GrammarMatcher(matcher)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """Room for ``rows`` masks: int32 words, one bit per token id."""
        return torch.zeros((rows, (self.vocab_size + 31) // 32), dtype=torch.int32)

    def prepare(self) -> None:
        """Builds the tokenizer's grammar-side form now (any thread; once)."""
        self._lltokenizer()

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        with self._building:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` int32 bitmask → ``[rows, vocab_size]`` bool (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
