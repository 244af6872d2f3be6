"""A CPU engine on cores other jobs come to share: tokens/s round by round, and its threads.

kvserve's ``LLM`` on ``--threads`` threads runs rounds back to back for ``--seconds``
(each round ``--batch`` fresh random prompts of ``--prompt-len`` tokens, ``--output-len``
new tokens each, greedy); from a third of the way to two thirds, ``--hogs`` CPU-bound
processes run on the same CPUs: another job wanting the engine's cores. Each wait setting
runs in a process of its own (libgomp reads it once, when torch loads), one after the
other, on the same model:

- ``governed``: kvserve's default (``GOMP_SPINCOUNT`` 100000 and the thread governor,
  :mod:`kvserve.engine.thread_governor`);
- ``short-spin``: ``GOMP_SPINCOUNT=1000``, kvserve's default before the governor (a
  user's own wait: nothing governed);
- ``long-spin`` (with ``--long-spin``): libgomp's own 300,000-spin wait, ungoverned.

Printed: each round's tok/s, the phase at its end (alone / shared / alone again; a round
that spans a change of phase counts in the later one) and whether the threads' waits were
short or long at its end (the governor's choice); then per setting the median tok/s of
each phase, side by side.

Run: ``python benchmarks/engine_shared_cores.py [--model DIR] [--threads 2] [--hogs 2]
[--seconds 90] [--dtype float32] [--long-spin]`` (without ``--model`` it makes the
1024-wide model of ``engine_vs_vllm.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from model_widths import WIDE, add_width_options, make_wide_model

SETTINGS = {
    "governed": {},
    "short-spin": {"GOMP_SPINCOUNT": "1000"},
    # libgomp's own count, set as a user would (so not governed)
    "long-spin": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"},
}
PHASES = ("alone", "shared", "alone again")


def serve(args: argparse.Namespace) -> None:
    """The engine's side: ready, then rounds for ``--seconds`` once told to go, a JSON
    line per round."""
    from kvserve import LLM, SamplingParams
    from kvserve.engine.device import use_threads

    use_threads(args.threads)
    llm = LLM(str(args.model), dtype=args.dtype, max_num_seqs=args.batch)
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    vocab = llm.engine.runner.config.vocab_size

    def round_tps() -> float:
        prompts = [
            [rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)
        ]
        started = time.perf_counter()
        llm.generate(prompts, params)
        return args.batch * args.output_len / (time.perf_counter() - started)

    round_tps()  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    ends = time.monotonic() + args.seconds
    while time.monotonic() < ends:
        tps = round_tps()
        _, short_waits, changes = llm.engine.runner.intra_op_threads()
        governed = llm.engine.runner.thread_governor is not None
        answer = {"tps": tps, "governed": governed, "short": short_waits, "changes": changes}
        print(json.dumps(answer), flush=True)
    print(json.dumps({"done": True}), flush=True)


def run_setting(args: argparse.Namespace, setting: str) -> list[tuple[str, float]]:
    """(phase, tok/s) per round of one setting."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(SETTINGS[setting])
    command = [sys.executable, __file__, "--serve", *sys.argv[1:], "--model", str(args.model)]
    engine = subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert engine.stdin is not None and engine.stdout is not None
    rounds: list[tuple[str, float]] = []
    hogs: list[subprocess.Popen[bytes]] = []

    def start_hogs() -> None:
        hogs.extend(
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)
        )

    timers = [
        threading.Timer(args.seconds / 3, start_hogs),
        threading.Timer(2 * args.seconds / 3, _stop, [hogs]),
    ]
    try:
        assert json.loads(engine.stdout.readline()).get("ready")
        engine.stdin.write("go\n")
        engine.stdin.flush()
        started = time.monotonic()
        for timer in timers:
            timer.start()
        for line in engine.stdout:
            answer = json.loads(line)
            if answer.get("done"):
                break
            elapsed = time.monotonic() - started
            phase = PHASES[min(2, int(3 * elapsed / args.seconds))]
            rounds.append((phase, answer["tps"]))
            waits = "short waits" if answer["short"] else "long waits"
            print(
                f"{setting:>10} {elapsed:6.1f} s {phase:>11}: {answer['tps']:7.1f} tok/s, "
                + (
                    f"{waits}, {answer['changes']} change(s)"
                    if answer["governed"]
                    else "not governed"
                ),
                flush=True,
            )
    finally:
        for timer in timers:
            timer.cancel()
            if timer.is_alive():
                timer.join()
        _stop(hogs)
        engine.kill()
        engine.wait()
    return rounds


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.kill()
        process.wait()
    processes.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help="model folder (default: made here)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--long-spin", action="store_true")
    parser.add_argument("--arch", default="qwen3")
    add_width_options(parser, **WIDE)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    if args.model is None:
        folder = Path(tempfile.mkdtemp(prefix="kvserve-shared-cores-")) / "model"
        args.model = make_wide_model(args, folder)
    settings = ["governed", "short-spin"] + (["long-spin"] if args.long_spin else [])
    medians = {}
    for setting in settings:
        rounds = run_setting(args, setting)
        medians[setting] = {
            phase: statistics.median([tps for p, tps in rounds if p == phase] or [0.0])
            for phase in PHASES
        }
    print(f"median tok/s per phase ({args.threads} threads, {args.hogs} hogs while shared):")
    for setting, by_phase in medians.items():
        print(f"{setting:>10}: " + ", ".join(f"{p} {by_phase[p]:.1f}" for p in PHASES))


if __name__ == "__main__":
    main()
