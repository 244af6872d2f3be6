"""When to restart a worker that died, and when its deaths amount to a crash loop.

A worker that served for a while and then died is restarted almost at once: its clients
are being retried elsewhere meanwhile, and the sooner it is back the sooner its capacity
is. A worker that dies again soon after each start is not helped by being restarted
faster: each quick death doubles the wait (up to a cap), so a broken worker costs little
CPU, and from the third quick death on it is reported as a crash loop every time, with
its log, instead of being restarted silently forever. Pure: times are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    multiplier: float = 2.0
    stable_after_s: float = 30.0  # a run at least this long was not part of a crash loop
    crash_loop_deaths: int = 3  # quick deaths in a row that make a crash loop


@dataclass(frozen=True, slots=True)
class RestartPlan:
    """What to do about one death."""

    delay_s: float  # wait this long, then start the worker again
    restarts: int  # restarts of this worker so far, this one included
    quick_deaths: int  # deaths in a row that came soon after a start
    crash_loop: bool


class RestartBackoff:
    """One worker's restart history."""

    def __init__(self, policy: RestartPolicy) -> None:
        self._policy = policy
        self._quick_deaths = 0
        self.restarts = 0

    def on_exit(self, ran_s: float) -> RestartPlan:
        """The worker died after running ``ran_s`` seconds since its last start."""
        policy = self._policy
        self._quick_deaths = 0 if ran_s >= policy.stable_after_s else self._quick_deaths + 1
        self.restarts += 1
        growth = policy.multiplier ** max(0, self._quick_deaths - 1)
        return RestartPlan(
            delay_s=min(policy.initial_delay_s * growth, policy.max_delay_s),
            restarts=self.restarts,
            quick_deaths=self._quick_deaths,
            crash_loop=self._quick_deaths >= policy.crash_loop_deaths,
        )
