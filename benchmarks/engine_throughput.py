"""Engine speed: kvserve vs ``transformers.generate``, and cached-prefix vs cold TTFT.

Both figures are ratios measured side by side in one run on the same tiny random model
(made here, no download) and the same prompts:

- offline throughput (generated tokens/s) at batch ``--batch``: kvserve's ``LLM.generate``
  vs ``transformers``' batched ``generate`` (left-padded, KV cache on), greedy, EOS off;
- time to first token of a ``--ttft-prompt``-token prompt whose first 90% is in the
  prefix cache vs the same length cold, through ``LLMEngine`` steps.

Rounds alternate between the contenders so machine noise hits both alike; the best round
(least disturbed by other jobs on a shared machine) and the median are both reported.
Run: ``python benchmarks/engine_throughput.py [--arch llama] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.tiny_model import ARCHES, make_tiny_model


def random_prompt(length: int, rng: random.Random, vocab_size: int) -> list[int]:
    return [rng.randrange(10, vocab_size) for _ in range(length)]


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> None:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)
    assert out.shape[1] == width + max_new_tokens


def throughput(args: argparse.Namespace, model_dir: Path) -> tuple[list[float], list[float]]:
    """Seconds per round of (kvserve, transformers) for the whole batch."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = LLM(model_dir, max_num_seqs=args.batch, max_num_batched_tokens=args.budget)
    vocab_size = llm.engine.runner.config.vocab_size
    rng = random.Random(0)
    lengths = [rng.randint(args.prompt_len // 2, args.prompt_len) for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    kvserve_s, hf_s = [], []
    for round_index in range(args.rounds + 1):  # round 0 warms both up
        # Fresh prompts each round: the prefix cache must not serve earlier rounds.
        prompts = [random_prompt(n, rng, vocab_size) for n in lengths]
        k = timed(lambda: llm.generate(prompts, params))  # noqa: B023
        h = timed(lambda: hf_generate(hf_model, prompts, args.output_len))  # noqa: B023
        if round_index:
            kvserve_s.append(k)
            hf_s.append(h)
    return kvserve_s, hf_s


def first_token_seconds(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1))
    while not engine.step():
        pass
    return time.perf_counter() - started


def ttft(args: argparse.Namespace, model_dir: Path) -> tuple[list[float], list[float]]:
    """Seconds to first token per round of (cold, 90%-cached) prompts."""
    rng = random.Random(1)
    engine = LLMEngine(model_dir, max_num_batched_tokens=args.budget)
    vocab_size = engine.runner.config.vocab_size
    shared = int(args.ttft_prompt * 0.9)
    cold_s, cached_s = [], []
    for round_index in range(args.rounds + 1):
        base = random_prompt(args.ttft_prompt, rng, vocab_size)
        cold = first_token_seconds(engine, f"cold-{round_index}", base)
        follow_up = base[:shared] + random_prompt(args.ttft_prompt - shared, rng, vocab_size)
        cached = first_token_seconds(engine, f"cached-{round_index}", follow_up)
        if round_index:
            cold_s.append(cold)
            cached_s.append(cached)
    return cold_s, cached_s


def best_and_median(seconds: list[float]) -> tuple[float, float]:
    return min(seconds), statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=ARCHES, default="llama")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--ttft-prompt", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=512, help="kvserve tokens per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / args.arch, args.arch, seed=0)
        ours, theirs = throughput(args, model_dir)
        cold, cached = ttft(args, model_dir)
    print(
        f"tiny {args.arch}, batch {args.batch}, prompts <= {args.prompt_len} tokens, "
        f"{args.output_len} generated each, budget {args.budget}, {args.rounds} rounds, "
        f"{args.threads} thread(s)"
    )
    tokens = args.batch * args.output_len
    for label, k, h in zip(("best", "median"), *map(best_and_median, (ours, theirs)), strict=True):
        print(
            f"throughput ({label:6})  kvserve {tokens / k:8.1f} tok/s   "
            f"transformers {tokens / h:8.1f} tok/s   ratio {h / k:.2f}x"
        )
    for label, c, w in zip(("best", "median"), *map(best_and_median, (cold, cached)), strict=True):
        print(
            f"TTFT {args.ttft_prompt} tokens ({label:6})  cold {c * 1000:7.1f} ms   "
            f"90% cached {w * 1000:7.1f} ms   ratio {w / c:.3f}"
        )


if __name__ == "__main__":
    main()
