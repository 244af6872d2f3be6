"""Rendering a model's chat template exactly as ``transformers`` does.

The router hashes the tokens of the rendered prompt to predict a worker's cache, so a
single differing character (whitespace trimming, JSON escaping) would break its
prediction. Hence the same jinja2 environment: sandboxed, ``trim_blocks`` and
``lstrip_blocks``, loop controls, ``raise_exception``, a ``tojson`` that does not
HTML-escape, ``strftime_now``, and the ``{% generation %}`` tag as a pass-through.
Torch-free: the router imports it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing, does not compile, or refused the messages."""


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    rendering ignores it, but templates using it must still parse."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 reads this class attribute

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"chat template does not compile: {err}") from None


def select_template(template: str | list[dict[str, str]] | None, *, has_tools: bool) -> str:
    """A folder may ship named templates; like transformers, prefer ``tool_use`` when
    tools are given, else ``default``."""
    if template is None:
        raise ChatTemplateError("the model folder has no chat template")
    if isinstance(template, str):
        return template
    named = {entry["name"]: entry["template"] for entry in template}
    for name in ("tool_use", "default") if has_tools else ("default",):
        if name in named:
            return named[name]
    raise ChatTemplateError(f"no default chat template among {sorted(named)}")


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    special_tokens: dict[str, str],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """``special_tokens`` (``bos_token``, ``eos_token``, ...) are visible to the template,
    overridden by ``template_kwargs`` as in transformers."""
    for message in messages:
        if not isinstance(message, dict):
            raise ChatTemplateError(f"a chat message must be a dict, got {type(message).__name__}")
    context = {**special_tokens, **template_kwargs}
    try:
        return _compile(template).render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"chat template refused the messages: {err}") from None
