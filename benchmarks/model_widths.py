"""The generated model's width options, shared by the engine benchmarks.

kvserve is imported only when a shape is made: ``engine_vs_vllm.py`` also parses its
options inside vLLM's venv, where kvserve is not importable.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.engine.tiny_model import TinyShape

WIDTHS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "num_layers", "head_dim")
# The engine benchmarks' default: a Qwen3-shaped model of 102M parameters, wide enough for
# the linears and attention to cost what they cost in real models
WIDE = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_heads": 16,
    "num_kv_heads": 8,
    "num_layers": 8,
    "head_dim": 64,
}


def add_width_options(parser: argparse.ArgumentParser, **defaults: int | None) -> None:
    """``--hidden-size`` and the rest; a width without a default takes the family's own."""
    for name in WIDTHS:
        default = defaults.get(name)
        help_text = "default: the family's own" if default is None else None
        option = "--" + name.replace("_", "-")
        parser.add_argument(option, type=int, default=default, help=help_text)


def shape_from(args: argparse.Namespace) -> TinyShape:
    from kvserve.engine.tiny_model import TinyShape

    return TinyShape(**{name: getattr(args, name) for name in WIDTHS})


def make_wide_model(args: argparse.Namespace, folder: Path) -> Path:
    """A random-weight model of ``--arch`` and the width options in ``folder``: what the
    engine benchmarks run on when no ``--model`` is given."""
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(folder, args.arch, seed=0, shape=shape_from(args))
