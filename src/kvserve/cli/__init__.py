"""The ``kvserve`` command. Each subcommand lives in its own module under ``kvserve.cli``
and registers itself; modules import heavy dependencies (torch) only when run."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="kvserve",
    help="KV-cache-centric LLM serving: engine workers, cache-aware router, bench, simulator.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Keeps typer in multi-command mode even while few commands exist."""


# One module per subcommand; each defines ``register(app)``.
_COMMAND_MODULES = [
    "version",
    "worker",
    "make_tiny_model",
    "bench",
    "router",
    "up",
    "simulate",
]

for _name in _COMMAND_MODULES:
    importlib.import_module(f"kvserve.cli.{_name}").register(app)


def main() -> None:
    app()
