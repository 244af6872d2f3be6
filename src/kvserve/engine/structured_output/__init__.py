"""Constrained decoding: a grammar matcher per structured request, and the mask of
tokens it allows applied to the logits before sampling."""

from kvserve.engine.structured_output.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    unpack_bitmask,
)

__all__ = ["GrammarCompiler", "GrammarError", "GrammarMatcher", "unpack_bitmask"]
