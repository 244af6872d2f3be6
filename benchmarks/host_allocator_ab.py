"""kvserve's CPU engine with and without keeping freed step memory (engine/host_allocator).

Two kvserve engine processes on the same cores, ``engine_vs_vllm.py``'s (its children,
workloads and wide model), one with glibc's defaults (``KVSERVE_KEEP_FREED_MEMORY=0``),
the other as kvserve runs; rounds alternate between them after one warm-up round. Per
workload: tokens/s, CPU and system seconds and minor page faults per round (medians), the
per-round tokens/s ratio's median, and whether both answered the same tokens (greedy:
they must).

Run: ``python benchmarks/host_allocator_ab.py [--model DIR] [--threads 1] [--dtype
float32] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from engine_vs_vllm import Engine, Workload, add_engine_options, workloads_from
from model_widths import make_wide_model

SWITCH = "KVSERVE_KEEP_FREED_MEMORY"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_options(parser)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    args.log_dir = Path(tempfile.mkdtemp(prefix="kvserve-allocator-"))
    args.model = args.model or make_wide_model(args, args.log_dir / "model")
    vocab_size = json.loads((args.model / "config.json").read_text())["vocab_size"]
    python = Path(sys.executable)
    engines = []
    try:
        for label, switch in (("kept", "1"), ("defaults", "0")):
            engines.append(Engine("kvserve", python, args, args.threads, {SWITCH: switch}, label))
        print(f"model {args.model}; {args.dtype}, {args.threads} thread(s), {args.rounds} rounds")
        rng = random.Random(args.seed)
        for workload in workloads_from(args).values():
            rows: dict[str, list[dict[str, Any]]] = {e.name: [] for e in engines}
            for round_index in range(args.rounds + 1):  # the first round warms up
                prompts = workload.prompts(rng, vocab_size)
                for engine in engines if round_index % 2 == 0 else engines[::-1]:
                    answer = engine.run(prompts, workload.output_len)
                    if round_index:
                        rows[engine.name].append(answer)
            report(workload, rows)
    finally:
        for engine in engines:
            engine.close()


def report(workload: Workload, rows: dict[str, list[dict[str, Any]]]) -> None:
    tokens = workload.batch * workload.output_len
    kept, default = rows["kept"], rows["defaults"]
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
        f"{workload.name}: {'; '.join(parts)}; kept/defaults tokens/s "
        f"{statistics.median(ratios):.2f}x (per round {per_round}); same tokens: {same}",
        flush=True,
    )


if __name__ == "__main__":
    main()
