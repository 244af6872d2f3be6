"""Does reading the Mooncake tier into registered buffers pay? ``get_batch`` vs
``batch_get_into``, side by side in one run.

The storage backend reads a chain's values with ``get_batch`` (the client copies each
value into a new ``bytes``). Mooncake can instead write the values straight into memory
registered with its client (``batch_get_into``), saving that copy. This puts 230 values
of one tiny-model block's size (what ``benchmarks/tiers.py`` loads) into a local store
(master + 1 GiB segment holder, TCP) and times both reads alternately.

Run: ``python benchmarks/mooncake_get_into.py [--rounds 15]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from mooncake.store import MooncakeDistributedStore

from tiers import start_mooncake

VALUES, VALUE_BYTES = 230, 16 * 1024 + 100  # a block of the tiny model, framed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        url, processes = start_mooncake(Path(root))
        try:
            store = MooncakeDistributedStore()
            master = url.removeprefix("mooncake://")
            assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master) == 0
            keys = [f"k{i}" for i in range(VALUES)]
            assert (
                store.put_batch(keys, [bytes([i % 256]) * VALUE_BYTES for i in range(VALUES)]) == 0
            )
            buffer = torch.empty(VALUES * VALUE_BYTES, dtype=torch.uint8)
            assert store.register_buffer(buffer.data_ptr(), buffer.nbytes) == 0
            addresses = [buffer.data_ptr() + i * VALUE_BYTES for i in range(VALUES)]
            copied, placed = [], []
            for _ in range(args.rounds):
                started = time.perf_counter()
                store.get_batch(keys)
                copied.append(time.perf_counter() - started)
                started = time.perf_counter()
                codes = store.batch_get_into(keys, addresses, [VALUE_BYTES] * VALUES)
                placed.append(time.perf_counter() - started)
                assert codes == [VALUE_BYTES] * VALUES, codes[:3]
            store.close()
        finally:
            for process in processes:
                process.kill()
                process.wait()
    a, b = statistics.median(copied), statistics.median(placed)
    print(f"{VALUES} values of {VALUE_BYTES} B, median of {args.rounds}")
    print(f"get_batch       {a * 1e3:7.1f} ms")
    print(f"batch_get_into  {b * 1e3:7.1f} ms  ({b / a:.2f}x get_batch)")


if __name__ == "__main__":
    main()
