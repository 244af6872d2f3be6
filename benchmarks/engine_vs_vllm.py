"""kvserve's engine vs vLLM's CPU build, side by side on one machine: tokens/s and CPU time.

Both engines run the same random-weight model (``make_tiny_model`` at realistic widths,
Qwen3-shaped by default: hidden 1024, 8 layers, 16/8 heads, head_dim 64, ~102M
parameters), the same prompts as token ids, greedy, EOS ignored, so both produce exactly
the requested tokens and their outputs can be compared token for token:

- **uniform**: ``--batch`` random prompts of ``--prompt-len`` tokens, ``--output-len`` new.
- **shared-prefix**: ``--batch`` prompts of one ``--prefix-len``-token prefix plus
  ``--suffix-len`` own tokens, ``--prefix-output-len`` new; prefix caching on in both.

Fresh random tokens are drawn every round (so no round reuses an earlier round's cache).
Each engine lives in its own long-lived process (vLLM's in ``.venv-vllm``, made by
``scripts/setup_vllm.sh``; vLLM single-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) pinned
to the same ``--threads`` cores with that many intra-op threads; the engines take turns,
round by round, so noise from other jobs on the machine hits both alike. Reported: median
tokens/s and process CPU seconds per round, the median of the per-round ratios, and token
agreement (identical outputs / all, in requests and tokens).

Run: ``python benchmarks/engine_vs_vllm.py [--threads 1 2] [--dtype float32 bfloat16]``
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from model_widths import WIDE, add_width_options, make_wide_model

ROOT = Path(__file__).resolve().parent.parent
# The environment each engine's process starts from, taken before kvserve is imported here
# (importing kvserve.engine sets GOMP_SPINCOUNT, kvserve's own default, which vLLM should
# not inherit: each engine runs with its own defaults).
INHERITED_ENV = dict(os.environ)
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# vLLM's CPU attention needs a block size that is a multiple of 32.
VLLM_BLOCK_SIZE = 128


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    shared_len: int  # tokens every prompt starts with (0: none)
    own_len: int  # tokens of each prompt after the shared ones
    output_len: int

    def prompts(self, rng: random.Random, vocab_size: int) -> list[list[int]]:
        def draw(n: int) -> list[int]:
            return [rng.randrange(10, vocab_size) for _ in range(n)]

        shared = draw(self.shared_len)
        return [shared + draw(self.own_len) for _ in range(self.batch)]

    def describe(self) -> str:
        prompt = f"({self.shared_len} shared + {self.own_len})" if self.shared_len else self.own_len
        return f"{self.batch} x {prompt} prompt x {self.output_len} new"


# ---- the per-engine child process -------------------------------------------------------


def _usage() -> tuple[float, float, int]:
    """CPU seconds, the system's part of them, and minor page faults so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_stime, usage.ru_minflt


def _serve_vllm(args: argparse.Namespace) -> Any:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=str(args.model),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        block_size=VLLM_BLOCK_SIZE,
        enable_prefix_caching=True,
        seed=0,
    )

    def generate(prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = SamplingParams(
            temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False
        )
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate


def _serve_kvserve(args: argparse.Namespace) -> Any:
    from kvserve import LLM, SamplingParams
    from kvserve.engine.device import use_threads

    use_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
    )

    def generate(prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        return [r.token_ids for r in llm.generate(prompts, params)]

    return generate


def serve(args: argparse.Namespace) -> None:
    """Answer one JSON line per request line on stdin: the outputs, wall, CPU and system
    seconds, and minor page faults."""
    # Only answers go to stdout: whatever the engines print goes to stderr instead.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    generate = (_serve_vllm if args.serve == "vllm" else _serve_kvserve)(args)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        before, wall = _usage(), time.perf_counter()
        outputs = generate(job["prompts"], job["output_len"])
        wall, after = time.perf_counter() - wall, _usage()
        cpu, system, faults = (b - a for a, b in zip(before, after, strict=True))
        answer = {"outputs": outputs, "wall": wall, "cpu": cpu, "sys": system, "faults": faults}
        print(json.dumps(answer), file=answers, flush=True)


# ---- the driver -------------------------------------------------------------------------


class Engine:
    """One engine (``name``: kvserve or vllm) in its child process, pinned to the
    benchmark's cores; ``env`` added to its environment, ``label`` naming it (default:
    ``name``) in logs and results."""

    def __init__(
        self,
        name: str,
        python: Path,
        args: argparse.Namespace,
        threads: int,
        env: dict[str, str] | None = None,
        label: str | None = None,
    ) -> None:
        self.name = label or name
        cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])
        env = {
            **INHERITED_ENV,
            "OMP_NUM_THREADS": str(threads),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": cores,
            "PYTHONPATH": str(ROOT / "src") if name == "kvserve" else "",
            **(env or {}),
        }
        command = [
            *("taskset", "-c", cores, str(python), __file__, "--serve", name),
            *("--model", str(args.model), "--dtype", args.dtype, "--threads", str(threads)),
            *("--max-model-len", str(args.max_model_len)),
            *("--max-num-seqs", str(args.max_num_seqs)),
            *("--max-batched-tokens", str(args.max_batched_tokens)),
        ]
        log = open(args.log_dir / f"{self.name}-{args.dtype}-{threads}.log", "w")  # noqa: SIM115
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )
        self._log = log
        started = time.perf_counter()
        self._read()  # the "ready" line
        self.startup_s = time.perf_counter() - started

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited; see {self._log.name}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        stdin: TextIO | None = self._process.stdin
        assert stdin is not None
        stdin.write(json.dumps({"prompts": prompts, "output_len": output_len}) + "\n")
        stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=120)
        self._log.close()


@contextmanager
def engines(args: argparse.Namespace, threads: int) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    try:
        for name, python in (("kvserve", Path(sys.executable)), ("vllm", VLLM_PYTHON)):
            started.append(Engine(name, python, args, threads))
        yield started
    finally:
        for engine in started:
            engine.close()


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int, int, int]:
    """(identical outputs, outputs, equal tokens before the first difference, tokens)."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    equal_tokens = 0
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            equal_tokens += 1
    return same, len(a), equal_tokens, sum(len(x) for x in a)


def measure(args: argparse.Namespace, threads: int, workloads: list[Workload]) -> None:
    vocab_size = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    with engines(args, threads) as (kvserve, vllm):
        print(
            f"\n## {args.dtype}, {threads} thread(s); start-up kvserve {kvserve.startup_s:.0f} s,"
            f" vLLM {vllm.startup_s:.0f} s"
        )
        for workload in workloads:
            prompts = workload.prompts(rng, vocab_size)  # warm-up: compile, allocate
            for engine in (kvserve, vllm):
                engine.run(prompts, workload.output_len)
            stats: dict[str, dict[str, list[float]]] = {
                e.name: {"tps": [], "cpu": []} for e in (kvserve, vllm)
            }
            agree = [0, 0, 0, 0]
            for round_index in range(args.rounds):
                prompts = workload.prompts(rng, vocab_size)
                order = (kvserve, vllm) if round_index % 2 == 0 else (vllm, kvserve)
                outputs = {}
                for engine in order:
                    answer = engine.run(prompts, workload.output_len)
                    tokens = sum(len(o) for o in answer["outputs"])
                    assert tokens == workload.batch * workload.output_len, (engine.name, tokens)
                    stats[engine.name]["tps"].append(tokens / answer["wall"])
                    stats[engine.name]["cpu"].append(answer["cpu"])
                    outputs[engine.name] = answer["outputs"]
                for i, value in enumerate(agreement(outputs["kvserve"], outputs["vllm"])):
                    agree[i] += value
            ours, theirs = stats["kvserve"], stats["vllm"]
            ratios = [a / b for a, b in zip(ours["tps"], theirs["tps"], strict=True)]
            cpu_ratios = [a / b for a, b in zip(theirs["cpu"], ours["cpu"], strict=True)]
            print(
                f"{workload.name:13} ({workload.describe()}), {args.rounds} rounds: "
                f"kvserve {statistics.median(ours['tps']):7.1f} tok/s "
                f"({statistics.median(ours['cpu']):5.2f} CPU s), "
                f"vLLM {statistics.median(theirs['tps']):7.1f} tok/s "
                f"({statistics.median(theirs['cpu']):5.2f} CPU s); "
                f"kvserve/vLLM tokens/s {statistics.median(ratios):.2f}x "
                f"(per round {', '.join(f'{r:.2f}' for r in ratios)}), "
                f"CPU-time ratio {statistics.median(cpu_ratios):.2f}x; agreement "
                f"{agree[0]}/{agree[1]} outputs, {agree[2]}/{agree[3]} tokens",
                flush=True,
            )


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The model, each engine's limits and the workloads' sizes: also what the engine
    child processes read (``host_allocator_ab.py`` takes them from here)."""
    parser.add_argument("--model", type=Path, help="model folder (default: made here)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--arch", default="qwen3")
    add_width_options(parser, **WIDE)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--prefix-output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)


def workloads_from(args: argparse.Namespace) -> dict[str, Workload]:
    """The uniform and shared-prefix workloads at the sizes ``add_engine_options`` read."""
    return {
        "uniform": Workload("uniform", args.batch, 0, args.prompt_len, args.output_len),
        "shared-prefix": Workload(
            "shared-prefix", args.batch, args.prefix_len, args.suffix_len, args.prefix_output_len
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", choices=["vllm", "kvserve"], help=argparse.SUPPRESS)
    add_engine_options(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["uniform", "shared-prefix"])
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    if not VLLM_PYTHON.exists():
        sys.exit(f"no {VLLM_PYTHON}: run scripts/setup_vllm.sh first")
    args.log_dir = Path(tempfile.mkdtemp(prefix="kvserve-vs-vllm-"))
    args.model = args.model or make_wide_model(args, args.log_dir / "model")
    all_workloads = workloads_from(args)
    workloads = [all_workloads[name] for name in args.workloads]
    print(f"model {args.model} ({args.arch}); logs in {args.log_dir}; cpu {os.cpu_count()} cores")
    for dtype in args.dtypes:
        args.dtype = dtype
        for threads in args.thread_counts:
            measure(args, threads, workloads)


if __name__ == "__main__":
    main()
