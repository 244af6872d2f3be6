"""``kvserve make-tiny-model DIR --arch {llama,qwen2,qwen3} [--seed N] [widths] [--dtype D]``."""

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
        hidden_size: Annotated[int, typer.Option(help="Residual width.")] = 64,
        intermediate_size: Annotated[int, typer.Option(help="MLP width.")] = 128,
        num_heads: Annotated[int, typer.Option(help="Query heads.")] = 4,
        num_kv_heads: Annotated[int, typer.Option(help="Key/value heads.")] = 2,
        num_layers: Annotated[
            int | None, typer.Option(help="Decoder layers (default: the family's).")
        ] = None,
        head_dim: Annotated[
            int | None, typer.Option(help="Width of a head (default: the family's).")
        ] = None,
        dtype: Annotated[
            str, typer.Option(help="Checkpoint dtype the config declares: float32 | bfloat16.")
        ] = "float32",
    ) -> None:
        """Write a deterministic random-weight model folder that runs offline: a few MB by
        default, realistic widths (for kernel benchmarks) with the width options."""
        from kvserve.engine.tiny_model import ARCHES, TinyShape, make_tiny_model

        if arch not in ARCHES:
            raise typer.BadParameter(f"choose one of {', '.join(ARCHES)}", param_hint="--arch")
        shape = TinyShape(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            num_layers=num_layers,
            head_dim=head_dim,
        )
        try:
            out = make_tiny_model(model_dir, arch, seed, shape, dtype)
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        typer.echo(f"wrote tiny {arch} model (seed {seed}) to {out}")
