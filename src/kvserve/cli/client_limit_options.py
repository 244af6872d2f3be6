"""The client-limit flags that ``kvserve worker``, ``kvserve router`` and ``kvserve up``
share (see :mod:`kvserve.core.client_limits`): declared once, grouped in one help panel
with the same defaults, and turned into :class:`ClientLimits` (or back into flags, for
the servers ``up`` starts) in one place, so the three commands cannot drift apart."""

from __future__ import annotations

from typing import Annotated, cast

import typer

from kvserve.core.client_limits import ClientLimits

LIMITS = ClientLimits()  # the defaults the flags show
_PANEL = "Client limits (slow, stalled or greedy clients)"


def _client_limit(help_text: str) -> typer.models.OptionInfo:
    return cast(typer.models.OptionInfo, typer.Option(help=help_text, rich_help_panel=_PANEL))


HeaderTimeout = Annotated[float, _client_limit("Seconds a request's headers may take.")]
BodyTimeout = Annotated[float, _client_limit("Seconds a request's body may take.")]
MaxHeaderBytes = Annotated[int, _client_limit("Request line and headers (431 beyond).")]
MaxConnections = Annotated[int, _client_limit("Connections at once (503 beyond).")]


def limits_from_flags(
    header_timeout: float, body_timeout: float, max_header_bytes: int, max_connections: int
) -> ClientLimits:
    """The limits the four flags give, or the flags' error as a usage error."""
    try:
        return ClientLimits(header_timeout, body_timeout, max_header_bytes, max_connections)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error


def client_limit_args(limits: ClientLimits) -> list[str]:
    """The flags that give a ``kvserve worker`` or ``kvserve router`` these limits."""
    return [
        "--header-timeout", str(limits.header_timeout_s),
        "--body-timeout", str(limits.body_timeout_s),
        "--max-header-bytes", str(limits.max_header_bytes),
        "--max-connections", str(limits.max_connections),
    ]  # fmt: skip
