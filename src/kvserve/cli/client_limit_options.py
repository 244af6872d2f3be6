"""The client-limit flags that ``kvserve worker`` and ``kvserve router`` share (see
:mod:`kvserve.core.client_limits`), grouped in one help panel with the same defaults."""

from __future__ import annotations

from typing import cast

import typer

from kvserve.core.client_limits import ClientLimits

LIMITS = ClientLimits()  # the defaults the flags show
_PANEL = "Client limits (slow, stalled or greedy clients)"


def client_limit(help_text: str) -> typer.models.OptionInfo:
    return cast(typer.models.OptionInfo, typer.Option(help=help_text, rich_help_panel=_PANEL))
