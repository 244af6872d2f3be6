"""Chaos under load: workers of ``kvserve up`` killed and hung while clients keep sending.

Starts ``kvserve up --runner sim`` (real workers, scheduler, KV cache and HTTP; cost-model
step times, no weights) with a round-robin router, keeps ``--clients`` closed-loop clients
sending completions (streamed and not, in turn), and injects faults one after another,
each on the next worker:

- ``kill``: SIGKILL. ``up`` restarts the worker on its port; the router's health checks
  notice the new instance and readmit it.
- ``stop``: SIGSTOP for ``--stop-seconds``, then SIGCONT. The router's health checks time
  out and take the worker out; after SIGCONT they readmit it.

Per fault it reports the requests that ended in the fault's window: answered in full,
failed (no answer, or an error status), streams cut mid-way (only a stream the victim had
started may be), retries the router made (``kvserve_router_retries``), the slowest
request (and the slowest unstreamed one); and the times from the fault to the router
taking the worker out (``detect``) and to the worker answering a request again
(``heal``).

Run: ``python benchmarks/chaos.py [--workers 3] [--clients 8] [--faults kill,stop,kill,stop]
[--stop-seconds 10] [--out runs/chaos.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.bench.steady_load import Outcome, SteadyLoad
from kvserve.cli.up import cache_dir
from kvserve.router.local_fleet import ServerProcess
from tests.support.metrics_text import by_label, samples
from tests.support.up_fleet import start_up, worker_pids

POLL_S = 0.05
HEAL_LIMIT_S = 120.0


def wait_for(condition: Callable[[], bool], what: str) -> float:
    """Poll ``condition``; the monotonic time it first held."""
    deadline = time.monotonic() + HEAL_LIMIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {HEAL_LIMIT_S}s: {what}")
        time.sleep(POLL_S)
    return time.monotonic()


def healthy(up: ServerProcess, worker_id: str) -> bool | None:
    workers = httpx.get(up.url + "/workers", timeout=10).json()["workers"]
    return next(w["healthy"] for w in workers if w["id"] == worker_id)


def retries(up: ServerProcess) -> float:
    return sum(
        by_label(samples(up.url + "/metrics"), "kvserve_router_retries_total", "worker").values()
    )


def served_since(load: SteadyLoad, worker_id: str, since: float) -> bool:
    return any(o.complete and o.worker == worker_id and o.started > since for o in load.outcomes())


def inject(up: ServerProcess, load: SteadyLoad, fault: str, index: int, stop_s: float) -> dict:
    """One fault on worker ``index``; its timings (seconds after the fault)."""
    name, worker_id = f"worker{index}", f"w{index}"
    pid = worker_pids(up, name)[-1]
    retries_before = retries(up)
    at = time.monotonic()
    if fault == "kill":
        os.kill(pid, signal.SIGKILL)
        restarted = wait_for(lambda: worker_pids(up, name)[-1] != pid, "restart")
        detect = None  # a quick restart may come back before health checks fail
        healed = wait_for(lambda: served_since(load, worker_id, restarted), "serving again")
        timings = {"restart": restarted - at}
    else:
        os.kill(pid, signal.SIGSTOP)
        try:
            detect = wait_for(lambda: healthy(up, worker_id) is False, "taken out") - at
            time.sleep(max(0.0, stop_s - (time.monotonic() - at)))  # the fault's length
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        healed = wait_for(lambda: served_since(load, worker_id, resumed), "serving again")
        timings = {"detect": detect, "resumed": resumed - at}
    timings["heal"] = healed - at
    return {
        "fault": fault,
        "worker": worker_id,
        "at": at,
        **timings,
        "retries": retries(up) - retries_before,
    }


def summarize(outcomes: list[Outcome], start: float, end: float) -> dict:
    window = [o for o in outcomes if start <= o.ended < end]
    return {
        "requests": len(window),
        "answered": sum(o.complete for o in window),
        "failed": sum(o.status is None or o.status != 200 for o in window),
        "streams_cut": sum(o.status == 200 and not o.complete for o in window),
        "slowest_s": _slowest(window),
        "slowest_unstreamed_s": _slowest([o for o in window if not o.streamed]),
    }


def _slowest(outcomes: list[Outcome]) -> float:
    return round(max((o.ended - o.started for o in outcomes), default=0.0), 2)


def _counts(summary: dict) -> str:
    return (
        f"{summary['requests']} requests: {summary['answered']} answered, "
        f"{summary['failed']} failed, {summary['streams_cut']} streams cut, "
        f"slowest {summary['slowest_s']}s (unstreamed {summary['slowest_unstreamed_s']}s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--faults", default="kill,stop,kill,stop")
    parser.add_argument("--stop-seconds", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=5.0, help="Seconds between faults.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    up = start_up(
        cache_dir(), "--workers", str(args.workers), "--runner", "sim", "--policy", "round_robin"
    )
    load = SteadyLoad(up.url, model="tiny-llama", clients=args.clients, max_tokens=args.max_tokens)
    faults: list[dict] = []
    try:
        load.start()
        time.sleep(args.settle)  # the load's pace, not synchronisation
        for i, fault in enumerate(args.faults.split(",")):
            faults.append(inject(up, load, fault, i % args.workers, args.stop_seconds))
            time.sleep(args.settle)
    finally:
        outcomes = load.stop()
        up.stop()
    began = min(o.started for o in outcomes)
    ends = [f["at"] for f in faults[1:]] + [max(o.ended for o in outcomes) + 1]
    for fault, end in zip(faults, ends, strict=True):
        fault |= summarize(outcomes, fault["at"], end)
        fault["at"] = round(fault["at"] - began, 1)
        timed = [k for k in ("restart", "detect", "resumed", "heal") if fault.get(k) is not None]
        timing = ", ".join(f"{k} {fault[k]:.1f}s" for k in timed)
        print(f"{fault['fault']:>4} {fault['worker']} at {fault['at']:6.1f}s: {timing}; ", end="")
        print(_counts(fault) + f", {fault['retries']:.0f} retries")
    total = summarize(outcomes, began, max(o.ended for o in outcomes) + 1)
    print("all: " + _counts(total))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"args": vars(args) | {"out": str(args.out)}, "faults": faults, "all": total},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
