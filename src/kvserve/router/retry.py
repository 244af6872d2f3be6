"""Exponential backoff with jitter between retries, so retries do not arrive in lockstep."""

from __future__ import annotations

import random
from collections.abc import Iterator

from kvserve.router.config import RetryConfig

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def backoff_delays(config: RetryConfig, rng: random.Random) -> Iterator[float]:
    """Seconds to wait before retry 1, 2, ... (at most ``config.max_retries`` of them)."""
    delay = config.initial_backoff_s
    for _ in range(config.max_retries):
        yield min(delay, config.max_backoff_s) * rng.uniform(1 - config.jitter, 1 + config.jitter)
        delay *= config.backoff_multiplier
