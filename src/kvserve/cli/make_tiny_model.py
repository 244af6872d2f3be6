"""``kvserve make-tiny-model DIR --arch {llama,qwen2,qwen3} [--seed N]``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command("make-tiny-model")
    def make_tiny_model_command(
        model_dir: Annotated[Path, typer.Argument(help="Folder to write (created if missing).")],
        arch: Annotated[str, typer.Option(help="Model family: llama, qwen2 or qwen3.")] = "llama",
        seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    ) -> None:
        """Write a deterministic random-weight model folder (a few MB) that runs offline."""
        from kvserve.engine.tiny_model import ARCHES, make_tiny_model

        if arch not in ARCHES:
            raise typer.BadParameter(f"choose one of {', '.join(ARCHES)}", param_hint="--arch")
        out = make_tiny_model(model_dir, arch, seed)
        typer.echo(f"wrote tiny {arch} model (seed {seed}) to {out}")
