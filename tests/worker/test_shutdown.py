"""SIGTERM: in-flight requests finish within the grace period, the rest are aborted, exit 0."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx

from kvserve.router.local_fleet import ServerProcess
from tests.worker.worker_process import AUTH, served_model, start_worker


class StreamReader(threading.Thread):
    """Reads one streamed completion into ``lines``; ``started`` is set at its first line."""

    def __init__(self, worker: ServerProcess, max_tokens: int) -> None:
        super().__init__()
        self.body = {
            "model": served_model(worker),
            "prompt": [5, 6, 7],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        self.url = f"{worker.url}/v1/completions"
        self.lines: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=AUTH, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except httpx.HTTPError as exc:
            self.lines.append(f"error: {type(exc).__name__}")
        finally:
            self.started.set()


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(
    tiny_model_dir: Path,
) -> None:
    # The long request asks for far more than the context allows, so it is capped at
    # thousands of tokens: many seconds, well past the grace period. The short one needs
    # a fraction of the grace period even on a loaded machine.
    worker = start_worker(tiny_model_dir, "--shutdown-timeout", "4")
    long, short = StreamReader(worker, 100_000), StreamReader(worker, 80)
    for reader in (long, short):
        reader.start()
        assert reader.started.wait(30)

    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(30) == 0, worker.log_tail()
    for reader in (short, long):
        reader.join(10)

    assert short.lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in short.lines[-2]
    assert "data: [DONE]" not in long.lines
    assert worker.stop() == 0
