"""What prompt logprobs (echo) cost, and what skipping the prefix cache for them costs.

Through ``LLMEngine`` in-process, on a tiny random Llama widened to ``--hidden-size``
(made here, no download), one ``--prompt-len``-token prompt at a time, one generated
token, timed from ``add_request`` to the finished output:

- **cold**: a fresh prompt, no logprobs (the whole prompt computed);
- **cached**: the same prompt again, no logprobs (only its last partial block computed);
- **echo, cached**: the same prompt again with ``prompt_logprobs=1``: the cache is not
  used (a cached block has K/V, not logits), so the whole prompt is computed, with the
  logits and log-softmax of every position.

Rounds alternate the three; the script prints each one's median and best.
Run: ``python benchmarks/prompt_logprobs.py [--rounds 5] [--prompt-len 2000]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.tiny_model import TinyShape, make_tiny_model


def timed(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> float:
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plain = SamplingParams(max_tokens=1, ignore_eos=True)
    echo = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    times: dict[str, list[float]] = {"cold": [], "cached": [], "echo, cached": []}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        shape = TinyShape(hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size)
        model = make_tiny_model(Path(tmp) / "tiny", "llama", shape=shape)
        engine = LLMEngine(model, num_blocks=1024, device="cpu", dtype="float32")
        for round_index in range(args.rounds + 1):  # round 0 warms up
            prompt = [rng.randrange(10, 900) for _ in range(args.prompt_len)]
            figures = {
                "cold": timed(engine, f"cold-{round_index}", prompt, plain),
                "cached": timed(engine, f"cached-{round_index}", prompt, plain),
                "echo, cached": timed(engine, f"echo-{round_index}", prompt, echo),
            }
            if round_index:
                for name, value in figures.items():
                    times[name].append(value)
    print(f"prompt {args.prompt_len} tokens, hidden {args.hidden_size}, {args.rounds} rounds")
    for name, values in times.items():
        print(f"{name:>13}: median {statistics.median(values):.3f} s, best {min(values):.3f} s")


if __name__ == "__main__":
    main()
