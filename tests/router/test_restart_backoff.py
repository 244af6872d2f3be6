"""The supervisor's restart delays: quick after a long run, doubling while a worker keeps
dying soon after each start, capped, and reported as a crash loop from the third."""

from __future__ import annotations

from kvserve.router.restart_backoff import RestartBackoff, RestartPolicy

POLICY = RestartPolicy(initial_delay_s=0.5, max_delay_s=4.0, stable_after_s=30.0)


def test_a_worker_that_served_a_while_is_restarted_at_once_each_time() -> None:
    backoff = RestartBackoff(POLICY)
    plans = [backoff.on_exit(ran_s=100.0) for _ in range(5)]
    assert [p.delay_s for p in plans] == [0.5] * 5
    assert [p.restarts for p in plans] == [1, 2, 3, 4, 5]
    assert not any(p.crash_loop for p in plans)


def test_quick_deaths_double_the_delay_up_to_the_cap_and_are_a_crash_loop_from_the_third() -> None:
    backoff = RestartBackoff(POLICY)
    plans = [backoff.on_exit(ran_s=1.0) for _ in range(6)]
    assert [p.delay_s for p in plans] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert [p.crash_loop for p in plans] == [False, False, True, True, True, True]


def test_a_stable_run_ends_the_crash_loop() -> None:
    backoff = RestartBackoff(POLICY)
    for _ in range(4):
        backoff.on_exit(ran_s=1.0)
    plan = backoff.on_exit(ran_s=60.0)
    assert (plan.delay_s, plan.quick_deaths, plan.crash_loop, plan.restarts) == (0.5, 0, False, 5)
