"""Invariant checks that stay checks: ``python -O`` removes ``assert`` statements, and a
worker's ``/debug/check`` must still find a broken ledger under it."""

from __future__ import annotations


class InvariantError(RuntimeError):
    """A data structure's own consistency check failed: a bug, never bad input."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`InvariantError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise InvariantError(message)
