"""A live progress bar for a run: items done, throughput and errors as they happen."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvserve.bench.metrics import RequestRecord


class LiveProgress:
    """Feeds a rich progress bar from the load generator's callbacks."""

    def __init__(self, total_items: int, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]bench"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task("bench", total=total_items, stats="")
        self._started = time.perf_counter()
        self._requests = 0
        self._errors = 0
        self._tokens = 0

    def __enter__(self) -> LiveProgress:
        self._started = time.perf_counter()
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def record(self, record: RequestRecord) -> None:
        self._requests += 1
        self._errors += not record.ok
        self._tokens += record.completion_tokens
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        stats = (
            f"{self._requests / elapsed:.2f} req/s  {self._tokens / elapsed:.1f} tok/s  "
            f"errors {self._errors}"
        )
        self._progress.update(self._task, stats=stats)

    def item_done(self) -> None:
        self._progress.advance(self._task)
