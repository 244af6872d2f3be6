"""kvserve's CPU engine with and without keeping freed step memory (engine/host_allocator).

Two engine processes on the same cores, one with glibc's defaults
(``KVSERVE_KEEP_FREED_MEMORY=0``), the other as kvserve runs; rounds alternate between
them. Per workload: tokens/s, CPU and system seconds and minor page faults per round
(medians), the per-round tokens/s ratio's median, and whether both answered the same
tokens (greedy: they must). The workloads are ``engine_vs_vllm.py``'s, on its wide model.

Run: ``python benchmarks/host_allocator_ab.py [--model DIR] [--threads 1] [--rounds 5]``
(``--serve`` is the per-engine child process this script starts itself).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from model_widths import WIDE, add_width_options, shape_from

ROOT = Path(__file__).resolve().parent.parent
# (batch, shared prefix tokens, own tokens, new tokens): engine_vs_vllm.py's two workloads
WORKLOADS = {"uniform": (16, 0, 256, 64), "shared-prefix": (16, 1024, 64, 32)}


def _usage() -> tuple[float, float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_stime, usage.ru_minflt


def serve(args: argparse.Namespace) -> None:
    """Answer one JSON line per job line on stdin: outputs, wall, CPU, system, faults."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the engine prints goes to stderr
    from kvserve import LLM, SamplingParams
    from kvserve.engine.device import use_threads

    use_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=16, max_num_batched_tokens=2048)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=job["output_len"], ignore_eos=True)
        before, wall = _usage(), time.perf_counter()
        outputs = [r.token_ids for r in llm.generate(job["prompts"], params)]
        wall, after = time.perf_counter() - wall, _usage()
        cpu, system, faults = (b - a for a, b in zip(before, after, strict=True))
        answer = {"outputs": outputs, "wall": wall, "cpu": cpu, "sys": system, "faults": faults}
        print(json.dumps(answer), file=answers, flush=True)


class Engine:
    def __init__(self, name: str, keep: bool, args: argparse.Namespace) -> None:
        self.name = name
        cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[: args.threads])
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(args.threads)}
        env["KVSERVE_KEEP_FREED_MEMORY"] = "1" if keep else "0"
        command = [
            *("taskset", "-c", cores, sys.executable, __file__, "--serve"),
            *("--model", str(args.model), "--dtype", args.dtype, "--threads", str(args.threads)),
        ]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({"prompts": prompts, "output_len": output_len}))
        self._process.stdin.write("\n")
        self._process.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=120)


def prompts(rng: random.Random, workload: tuple[int, int, int, int], vocab: int) -> list[list[int]]:
    batch, shared_len, own_len, _ = workload
    shared = [rng.randrange(vocab) for _ in range(shared_len)]
    return [shared + [rng.randrange(vocab) for _ in range(own_len)] for _ in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help="model folder (default: made here)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--arch", default="qwen3")
    add_width_options(parser, **WIDE)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    if args.model is None:
        from kvserve.engine.tiny_model import make_tiny_model

        folder = Path(tempfile.mkdtemp(prefix="kvserve-allocator-")) / "model"
        args.model = make_tiny_model(folder, args.arch, seed=0, shape=shape_from(args))
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    engines = [Engine("kept", True, args), Engine("glibc defaults", False, args)]
    try:
        print(f"model {args.model}; {args.dtype}, {args.threads} thread(s), {args.rounds} rounds")
        for name, workload in WORKLOADS.items():
            rng = random.Random(0)
            rows: dict[str, list[dict[str, Any]]] = {e.name: [] for e in engines}
            for round_index in range(args.rounds + 1):  # the first round warms up
                batch = prompts(rng, workload, vocab)
                order = engines if round_index % 2 == 0 else engines[::-1]
                for engine in order:
                    answer = engine.run(batch, workload[3])
                    if round_index:
                        rows[engine.name].append(answer)
            report(name, workload, rows)
    finally:
        for engine in engines:
            engine.close()


def report(name: str, workload: tuple[int, int, int, int], rows: dict[str, list[dict]]) -> None:
    tokens = workload[0] * workload[3]
    kept, default = rows["kept"], rows["glibc defaults"]
    ratios = [d["wall"] / k["wall"] for k, d in zip(kept, default, strict=True)]
    same = all(k["outputs"] == d["outputs"] for k, d in zip(kept, default, strict=True))
    parts = []
    for label, answers in rows.items():
        median = {key: statistics.median(a[key] for a in answers) for key in ("wall", "cpu", "sys")}
        faults = statistics.median(a["faults"] for a in answers)
        parts.append(
            f"{label} {tokens / median['wall']:6.1f} tok/s, CPU {median['cpu']:.2f} s, "
            f"system {median['sys']:.3f} s, {faults:,.0f} page faults"
        )
    per_round = ", ".join(f"{r:.2f}" for r in ratios)
    print(
        f"{name}: {'; '.join(parts)}; kept/defaults tokens/s {statistics.median(ratios):.2f}x "
        f"(per round {per_round}); same tokens: {same}"
    )


if __name__ == "__main__":
    main()
