"""``kvserve version``."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def version() -> None:
        """Print the kvserve version."""
        from kvserve import __version__

        typer.echo(__version__)
