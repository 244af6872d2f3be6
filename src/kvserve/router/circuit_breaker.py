"""Per-worker circuit breaker: stop sending to a worker that keeps failing, probe later.

Health checks see a worker that is down; the breaker sees one that answers ``/health``
but fails real requests. Pure state machine: the time is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from kvserve.router.config import CircuitBreakerConfig


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, config: CircuitBreakerConfig) -> None:
        self._config = config
        self.state = BreakerState.CLOSED
        # Called when it opens or stops being open: the registry's accepting lists change.
        self.on_open_change: Callable[[], None] | None = None
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0

    def allows(self, now: float) -> bool:
        """Whether the worker may take a request; an expired open state turns half-open."""
        if self.state is BreakerState.OPEN and now - self._opened_at >= self._config.open_s:
            self._half_open()
        return self.state is not BreakerState.OPEN

    @property
    def reopens_at(self) -> float:
        """When an open breaker lets trial traffic through (meaningless when not open)."""
        return self._opened_at + self._config.open_s

    def readmit(self) -> None:
        """The worker came back (healthy again, or restarted): its past failures were the
        old process's, so trial traffic flows now instead of when ``open_s`` ends."""
        if self.state is BreakerState.OPEN:
            self._half_open()
        self._failures = 0

    def record_success(self) -> None:
        self._failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self._successes += 1
            if self._successes >= self._config.success_threshold:
                self.state = BreakerState.CLOSED

    def record_failure(self, now: float) -> None:
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or self._failures >= self._config.failure_threshold:
            self.state = BreakerState.OPEN
            self._opened_at = now
            self._failures = 0
            self._notify()

    def _half_open(self) -> None:
        self.state = BreakerState.HALF_OPEN
        self._successes = 0
        self._notify()

    def _notify(self) -> None:
        if self.on_open_change is not None:
            self.on_open_change()
