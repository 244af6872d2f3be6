"""The circuit breaker's state machine, driven by a fake clock value."""

from __future__ import annotations

from kvserve.router.circuit_breaker import BreakerState, CircuitBreaker
from kvserve.router.config import CircuitBreakerConfig

CONFIG = CircuitBreakerConfig(failure_threshold=3, success_threshold=2, open_s=10.0)


def test_opens_after_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(CONFIG)
    breaker.record_failure(now=0.0)
    breaker.record_failure(now=0.0)
    breaker.record_success()
    breaker.record_failure(now=0.0)
    breaker.record_failure(now=0.0)
    assert breaker.allows(now=0.0)
    breaker.record_failure(now=1.0)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allows(now=10.9)


def test_half_open_closes_after_successes_and_reopens_on_failure() -> None:
    breaker = CircuitBreaker(CONFIG)
    for _ in range(3):
        breaker.record_failure(now=0.0)
    assert breaker.allows(now=10.0)
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_failure(now=10.0)
    assert breaker.state is BreakerState.OPEN
    assert breaker.allows(now=20.0)
    breaker.record_success()
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED


def test_readmit_lets_trial_traffic_through_before_open_s_ends() -> None:
    breaker = CircuitBreaker(CONFIG)
    for _ in range(3):
        breaker.record_failure(now=0.0)
    assert not breaker.allows(now=1.0)
    breaker.readmit()  # the worker came back (restarted, or healthy again)
    assert breaker.allows(now=1.0)
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_failure(now=1.0)  # a trial failure shuts it again
    assert not breaker.allows(now=2.0)
