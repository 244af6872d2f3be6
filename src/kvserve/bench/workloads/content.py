"""Deterministic prompt content: a block of text or token ids per key.

Traces and generators describe prompts by structure (which blocks are shared), not by
content. Every block key maps to the same content in every process and run, so two
prompts built from the same keys share exactly that prefix — as token ids in token mode,
as characters in text mode. Text mode exists because routers that look at characters
(SGLang's cache_aware, vLLM's router) would be unfairly blinded by token-id prompts.

Text blocks are common English words, each with its leading space: byte-level BPE
tokenizers split before a space, so one word is about one token and no token spans two
blocks; a text block of ``n`` words is therefore roughly ``n`` tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import lru_cache
from typing import cast

from kvserve.bench.workloads.base import Prompt, Workload, untimed_prompts

BlockKeys = list[tuple[str, int]]  # (key, length) of each block of a prompt, in order

_WORD_TEXT = """
    time year people way day man thing woman life child world school state family
    student group country problem hand part place case week company system program
    question work government number night point home water room mother area money
    story fact month lot right study book eye job word business issue side kind head
    house service friend father power hour game line end member law car city name
    president team minute idea kid body information back parent face others level
    office door health person art war history party result change morning reason
    research girl guy moment air teacher force education foot boy age policy music
    market sense nation plan college interest death experience effect class control
    care field development role effort rate heart drug show leader light voice wife
    police mind price report decision son view relationship town road arm difference
    value building action model season society tax director position player record
    paper space ground form event official matter center couple site project activity
    star table need court oil situation cost industry figure street image phone data
    picture practice piece land product doctor wall patient worker news test movie
    north love support technology step baby computer type attention film tree source
    organization hair window evidence population truth song bank letter blue green
    river stone bread garden summer winter train bridge glass cloud island
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

MODES = ("text", "tokens")
_FIRST_TOKEN_ID = 10  # keeps clear of the low special ids (bos/eos/pad) of common vocabularies


class ContentMaker:
    """Builds prompt pieces for one mode; equal keys give equal content."""

    def __init__(self, mode: str = "text", vocab: int = 32000) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if vocab <= _FIRST_TOKEN_ID:
            raise ValueError(f"vocab must be > {_FIRST_TOKEN_ID}, got {vocab}")
        self.mode = mode
        self.vocab = vocab

    def block(self, key: str, length: int) -> Prompt:
        """``length`` words or token ids determined by ``key`` alone.

        A shorter block under the same key is a prefix of a longer one, so truncating a
        trace's last block keeps the sharing structure.
        """
        if self.mode == "text":
            return "".join(_words(key, length))
        return _token_ids(key, length, self.vocab)

    def join(self, pieces: list[Prompt]) -> Prompt:
        if self.mode == "text":
            return "".join(cast(list[str], pieces))
        return tuple(token for piece in cast(list[tuple[int, ...]], pieces) for token in piece)


def block_prompts(
    name: str,
    count: int,
    blocks_of: Callable[[int], BlockKeys],
    *,
    max_tokens: int,
    mode: str,
    vocab: int,
) -> Workload:
    """An untimed workload of ``count`` completion prompts, prompt ``i`` made of the blocks
    ``blocks_of(i)`` names (called in order of ``i``): generators state only what is
    shared."""
    maker = ContentMaker(mode, vocab)
    prompts = [
        maker.join([maker.block(key, length) for key, length in blocks_of(index)])
        for index in range(count)
    ]
    return untimed_prompts(name, prompts, max_tokens)


def text_block(key: str, length: int) -> str:
    """Text of ``length`` words for chat sources, which are text only."""
    return "".join(_words(key, length)).lstrip()


@lru_cache(maxsize=65536)
def _words(key: str, length: int) -> tuple[str, ...]:
    rng = random.Random(key)  # str seeds hash with SHA-512: stable across processes
    return tuple(" " + rng.choice(WORDS) for _ in range(length))


@lru_cache(maxsize=65536)
def _token_ids(key: str, length: int, vocab: int) -> tuple[int, ...]:
    rng = random.Random(key)
    return tuple(rng.randrange(_FIRST_TOKEN_ID, vocab) for _ in range(length))
