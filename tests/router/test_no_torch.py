"""The router installs and starts without torch: importing it must load neither torch nor
the engine (the model folder's tokenizer and chat template come from ``kvserve.model_folder``).

Each probe runs in a fresh interpreter, so that modules other tests imported do not count.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Every module of the router and of its policies' pure logic, then `kvserve router --help`
# (which also registers the other commands), then kv_aware's prompt hasher at work.
PROBE = """
import importlib
import pkgutil
import sys

import kvserve.core.routing
import kvserve.router

model_dir = sys.argv[1]

for package in (kvserve.router, kvserve.core.routing):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)

from kvserve.cli import main

sys.argv = ["kvserve", "router", "--help"]
try:
    main()
except SystemExit:
    pass

from kvserve.router.prompt_tokens import PromptHasher

body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there, how are you?"}]}
blocks = PromptHasher(model_dir).blocks(body, block_size=4)
assert blocks is not None and blocks.reusable_hashes, blocks

unwanted = sorted(m for m in sys.modules if m == "torch" or m.startswith("kvserve.engine"))
print("unwanted modules loaded:", unwanted)
"""


def test_router_its_policies_and_prompt_hasher_leave_torch_and_the_engine_unloaded(
    tiny_model_dir: Path,
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "--worker-urls" in result.stdout
    assert result.stdout.splitlines()[-1] == "unwanted modules loaded: []"
