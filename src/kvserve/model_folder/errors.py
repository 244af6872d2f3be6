"""The error of a model folder that cannot be used, raised wherever it is read: its config
and tokenizer here, its weights in the engine; the router and the worker report it as is."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model folder cannot be used; the message is one line naming what is wrong."""
