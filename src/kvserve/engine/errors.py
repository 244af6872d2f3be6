"""Errors the engine raises to callers."""

from __future__ import annotations

from kvserve.core.sampling_params import InvalidParameterError


class InvalidRequestError(InvalidParameterError):
    """This request cannot be served as given (a 4xx); other requests are unaffected.

    A subclass of :class:`InvalidParameterError` (a ``ValueError``), so that one
    ``except`` covers bad sampling parameters and bad prompts, with ``param`` naming
    the field at fault.
    """
