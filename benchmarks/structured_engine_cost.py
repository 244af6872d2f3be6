"""What constrained decoding adds per generated token inside ``LLMEngine``.

``--batch`` requests, each with its own random JSON schema (the tests' generator), run to
completion; then the same prompts run unconstrained with ``ignore_eos`` and each request's
``max_tokens`` set to the length its constrained twin reached, so both runs compute the
same tokens in the same batches. The difference in wall time over the constrained tokens
is the engine's per-token cost of structured output: the grammar's mask, unpacking it,
masking the logits and advancing the matcher. Best of ``--rounds`` alternating rounds.

    python benchmarks/structured_engine_cost.py --batch 16 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.core.structured_output import StructuredOutput
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.tiny_model import make_tiny_model
from tests.support.json_schemas import random_schemas

PROMPT = "Reply in JSON."


def run(engine: LLMEngine, params: list[SamplingParams]) -> tuple[float, list[int]]:
    """Wall time of the whole batch, and each request's number of generated tokens."""
    for i, p in enumerate(params):
        engine.add_request(str(i), PROMPT, p)
    lengths = [0] * len(params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                lengths[int(output.request_id)] = output.completion_tokens
    return time.perf_counter() - start, lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--arch", default="llama")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()), args.arch)
    engine = LLMEngine(model_dir, num_blocks=1024, device="cpu")
    engine.grammars.prepare()
    schemas = [json.dumps(s) for s in random_schemas(args.batch, seed=0)]
    constrained = [
        SamplingParams(max_tokens=400, seed=i, structured_output=StructuredOutput(s))
        for i, s in enumerate(schemas)
    ]
    _, lengths = run(engine, constrained)  # warm-up, and the lengths to match
    free = [SamplingParams(max_tokens=n, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    best_constrained = best_free = float("inf")
    for _ in range(args.rounds):
        elapsed, again = run(engine, constrained)
        assert again == lengths, "seeded constrained runs are reproducible"
        best_constrained = min(best_constrained, elapsed)
        elapsed, matched = run(engine, free)
        assert matched == lengths
        best_free = min(best_free, elapsed)
    tokens = sum(lengths)
    print(f"{args.batch} requests, {tokens} tokens (mean {tokens / args.batch:.1f} each)")
    print(f"constrained   {best_constrained:.3f} s  {1e6 * best_constrained / tokens:.1f} µs/token")
    print(f"unconstrained {best_free:.3f} s  {1e6 * best_free / tokens:.1f} µs/token")
    print(f"added         {1e6 * (best_constrained - best_free) / tokens:.1f} µs/token")


if __name__ == "__main__":
    main()
