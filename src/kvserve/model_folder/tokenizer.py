"""A model folder's tokenizer: ``tokenizer.json`` plus what ``tokenizer_config.json``,
``config.json`` and ``generation_config.json`` add (special tokens, chat template, stops).

Torch-free: the router loads it to hash prompts exactly as the worker will tokenize them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from kvserve.model_folder.chat_template import render_chat_template, select_template
from kvserve.model_folder.config import read_json, token_id_list
from kvserve.model_folder.errors import ModelLoadError

_SPECIAL_TOKEN_FIELDS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Decoding restarts this many tokens before the new ones, so that context-dependent
# decoders (leading-space rules) see what they need.
_DETOKENIZE_CONTEXT = 6


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        folder = Path(model_dir)
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise ModelLoadError(f"tokenizer.json not found in model folder {folder}")
        try:
            self._tokenizer = HFTokenizer.from_file(str(tokenizer_path))
        except Exception as err:  # the tokenizers library raises a bare Exception
            raise ModelLoadError(f"{tokenizer_path}: unreadable tokenizer ({err})") from None
        tokenizer_config = _optional_json(folder / "tokenizer_config.json")
        self.special_tokens: dict[str, str] = {
            field: text
            for field in _SPECIAL_TOKEN_FIELDS
            if (text := _token_text(tokenizer_config.get(field))) is not None
        }
        self.bos_token_id = self.token_to_id(self.special_tokens.get("bos_token"))
        self.eos_token_ids = self._stop_ids(folder, tokenizer_config)
        template_file = folder / "chat_template.jinja"
        self.chat_template: str | list[dict[str, str]] | None = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else tokenizer_config.get("chat_template")
        )
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text: what grammar libraries read its
        vocabulary and byte encoding from."""
        text: str = self._tokenizer.to_str()
        return text

    def token_to_id(self, token: str | None) -> int | None:
        """The id of a token (special or not), None if the vocabulary lacks it."""
        return None if token is None else self._tokenizer.token_to_id(token)

    def _stop_ids(self, folder: Path, tokenizer_config: dict[str, Any]) -> frozenset[int]:
        """Every id that ends generation: generation_config.json's (what transformers'
        ``generate`` stops on), config.json's, and the tokenizer's eos token."""
        ids = set(
            token_id_list(_optional_json(folder / "generation_config.json").get("eos_token_id"))
        )
        ids |= set(token_id_list(_optional_json(folder / "config.json").get("eos_token_id")))
        eos = self.token_to_id(_token_text(tokenizer_config.get("eos_token")))
        if eos is not None:
            ids.add(eos)
        return frozenset(ids)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """With ``add_special_tokens`` the tokenizer's post-processor adds what the model
        expects around raw text (BOS for Llama); a rendered chat prompt already has it."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``encode`` run by the tokenizers library on its own threads, outside the GIL:
        the router's event loop keeps serving while a long prompt is tokenized (a Python
        worker thread calling ``encode`` still stalls it)."""
        encoding = await self._tokenizer.async_encode(text, add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        template = select_template(self.chat_template, has_tools=bool(tools))
        return render_chat_template(
            template,
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **template_kwargs,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The prompt tokens of a chat, as transformers' ``apply_chat_template(tokenize=True)``
        makes them: the template writes any BOS itself, so none is added."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, whose concatenation is the text the tokens
    add after the prompt (with the prompt's last tokens as decoding context, so a leading
    space or a merged character comes out as it does in the whole decoded text).

    Each step decodes a short window that ends with the new tokens and emits the part
    past what the window's older tokens decode to. A delta ending in U+FFFD means a
    multi-byte character is still incomplete, so nothing is emitted until it completes
    (or until ``finish``): a client never sees a broken character.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], *, skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._ids)  # tokens before this are already emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the newly complete text (possibly empty)."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """Whatever is still held back, incomplete characters included."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        emitted = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset)
        if len(window) <= len(emitted) or (window.endswith("\ufffd") and not final):
            return ""
        delta = window[len(emitted) :]
        # Move the window up to the tokens just emitted, keeping some context.
        self._prefix_offset = max(self._read_offset, len(self._ids) - _DETOKENIZE_CONTEXT)
        self._read_offset = len(self._ids)
        return delta


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path, what=path.name) if path.is_file() else {}
