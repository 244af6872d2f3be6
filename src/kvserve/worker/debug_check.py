"""``/debug/check`` kept cheap for the engine: the check walks every block on the engine
thread, so whoever can reach the port could otherwise stall generation by calling it in a
loop. One check runs at a time, and the next may start only after ten times the last one's
duration has passed, so checks take at most about a tenth of the engine's time whatever
the pool size; a refused call is told when to come back."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

# After a check that took d seconds, the next waits 10 d: at most ~9% of the engine's time.
_IDLE_FACTOR = 10.0


class CheckRefused(Exception):
    """Too soon after the last check, or one is running: retry after ``retry_after_s``."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"a KV check ran moments ago; retry in {retry_after_s:.3f}s")
        self.retry_after_s = retry_after_s


class CheckBudget:
    """Admits one check at a time, spaced by its own cost."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._running = False
        self._next_allowed = -math.inf

    async def run(self, check: Callable[[], Awaitable[None]]) -> None:
        """Run ``check`` now, or raise :class:`CheckRefused` without running it."""
        now = self._clock()
        if self._running:
            raise CheckRefused(0.0)
        if now < self._next_allowed:
            raise CheckRefused(self._next_allowed - now)
        self._running = True
        try:
            await check()
        finally:
            ended = self._clock()
            self._next_allowed = ended + _IDLE_FACTOR * (ended - now)
            self._running = False
