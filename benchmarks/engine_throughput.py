"""Engine speed: kvserve vs ``transformers.generate``, and cached-prefix vs cold TTFT.

All figures are ratios measured side by side in one run on the same tiny random model
(made here, no download) and the same prompts, greedy, EOS off (every request produces
exactly its ``max_tokens``; vLLM's offline benchmark does the same):

- **uniform**: ``--batch`` prompts of ``--prompt-len``/2 to ``--prompt-len`` random tokens,
  ``--output-len`` tokens each. ``transformers`` runs them as one left-padded batch; no
  row finishes early, so its static batching wastes nothing but the padding.
- **varied**: ``--varied-requests`` prompts of 32-512 tokens asking 16-256 tokens each,
  the usual offline workload. ``transformers`` runs them in arrival order in left-padded
  batches of ``--batch``, each generating its longest request's count (rows that asked
  for fewer are cut afterwards, as in vLLM's ``run_hf``); kvserve queues all of them with
  ``max_num_seqs=--batch`` and continuous batching. Only requested tokens count.
- **TTFT** of a ``--ttft-prompt``-token prompt whose first 90% is in the prefix cache vs
  the same length cold, through ``LLMEngine`` steps.

Rounds alternate between the contenders so machine noise hits both alike; the best round
(least disturbed by other jobs on a shared machine) and the median are both reported, and
the median of the per-round ratios in wall time and in process CPU time (which other jobs
disturb least). Both sides run with ``--threads`` torch threads, on ``--device`` (default:
the engine's own choice, CUDA where there is one) in ``--dtype``; the width options make the
model realistic (kernel speed means little on the default few-MB model).
Run: ``python benchmarks/engine_throughput.py [--arch llama] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.tiny_model import ARCHES, TinyShape, make_tiny_model
from model_widths import WIDTHS, add_width_options, shape_from


@dataclass(frozen=True)
class Workload:
    """Prompt lengths and output counts; fresh random tokens are drawn for every round."""

    name: str
    prompt_lengths: list[int]
    output_lengths: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lengths)


def random_prompt(length: int, rng: random.Random, vocab_size: int) -> list[int]:
    return [rng.randrange(10, vocab_size) for _ in range(length)]


@dataclass(frozen=True)
class Timing:
    wall: float
    cpu: float  # process CPU time: what other jobs on a shared machine disturb least


def timed(fn: Callable[[], object], device: torch.device) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":  # transformers' last kernels may still be queued
        torch.cuda.synchronize(device)
    return Timing(time.perf_counter() - wall, time.process_time() - cpu)


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> None:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    attention_mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
    )
    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)
    assert out.shape[1] == width + max_new_tokens


def hf_static_batches(model, prompts: list[list[int]], outputs: list[int], batch: int) -> None:
    """Consecutive batches, each run until its longest request is done."""
    for first in range(0, len(prompts), batch):
        hf_generate(model, prompts[first : first + batch], max(outputs[first : first + batch]))


def kvserve_generate(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> None:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    results = llm.generate(prompts, params)
    assert [len(r.token_ids) for r in results] == outputs


def throughput(
    args: argparse.Namespace, model_dir: Path, workloads: list[Workload]
) -> dict[str, tuple[list[Timing], list[Timing]]]:
    """Times per round of (kvserve, transformers) for each whole workload."""
    llm = LLM(
        model_dir,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.budget,
        device=args.device,
        dtype=args.dtype,
    )
    device, dtype = llm.engine.runner.device, llm.engine.runner.dtype
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    vocab_size = llm.engine.runner.config.vocab_size
    rng = random.Random(0)
    seconds: dict[str, tuple[list[Timing], list[Timing]]] = {w.name: ([], []) for w in workloads}
    for round_index in range(args.rounds + 1):  # round 0 warms both up
        for workload in workloads:
            # Fresh prompts each round: the prefix cache must not serve earlier rounds.
            prompts = [random_prompt(n, rng, vocab_size) for n in workload.prompt_lengths]
            outputs = workload.output_lengths
            k = timed(lambda: kvserve_generate(llm, prompts, outputs), device)  # noqa: B023
            h = timed(
                lambda: hf_static_batches(hf_model, prompts, outputs, args.batch),  # noqa: B023
                device,
            )
            if round_index:
                seconds[workload.name][0].append(k)
                seconds[workload.name][1].append(h)
    return seconds


def first_token_seconds(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1))
    while not engine.step():
        pass
    return time.perf_counter() - started


def ttft(args: argparse.Namespace, model_dir: Path) -> tuple[list[float], list[float]]:
    """Seconds to first token per round of (cold, 90%-cached) prompts."""
    rng = random.Random(1)
    engine = LLMEngine(
        model_dir, max_num_batched_tokens=args.budget, device=args.device, dtype=args.dtype
    )
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


def make_workloads(args: argparse.Namespace) -> list[Workload]:
    rng = random.Random(2)
    uniform = Workload(
        "uniform",
        [rng.randint(args.prompt_len // 2, args.prompt_len) for _ in range(args.batch)],
        [args.output_len] * args.batch,
    )
    count = args.varied_requests
    varied = Workload(
        "varied",
        [rng.randint(32, 512) for _ in range(count)],
        [rng.randint(16, 256) for _ in range(count)],
    )
    return [uniform, varied]


def best_and_median(seconds: list[float]) -> tuple[float, float]:
    return min(seconds), statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=ARCHES, default="llama")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--varied-requests", type=int, default=128)
    parser.add_argument("--ttft-prompt", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=512, help="kvserve tokens per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both")
    parser.add_argument("--device", help="cpu | cuda (default: the engine's choice)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | auto")
    add_width_options(parser, **{name: getattr(TinyShape(), name) for name in WIDTHS})
    args = parser.parse_args()
    shape = shape_from(args)
    torch.set_num_threads(args.threads)
    workloads = make_workloads(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / args.arch, args.arch, seed=0, shape=shape)
        seconds = throughput(args, model_dir, workloads)
        cold, cached = ttft(args, model_dir)
    where = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"{args.arch} {shape}, {args.dtype} on {where}, max batch {args.batch}, "
        f"budget {args.budget} tokens/step, {args.rounds} rounds, "
        f"{torch.get_num_threads()} torch thread(s) for both"
    )
    for workload in workloads:
        ours, theirs = seconds[workload.name]
        tokens = workload.output_tokens
        print(
            f"{workload.name}: {len(workload.prompt_lengths)} requests, prompts "
            f"{min(workload.prompt_lengths)}-{max(workload.prompt_lengths)} tokens, "
            f"{tokens} output tokens"
        )
        walls = [t.wall for t in ours], [t.wall for t in theirs]
        for label, k, h in zip(("best", "median"), *map(best_and_median, walls), strict=True):
            print(
                f"  throughput ({label:6})  kvserve {tokens / k:8.1f} tok/s   "
                f"transformers {tokens / h:8.1f} tok/s   ratio {h / k:.2f}x"
            )
        paired = statistics.median(h.wall / k.wall for k, h in zip(ours, theirs, strict=True))
        cpu = statistics.median(h.cpu / k.cpu for k, h in zip(ours, theirs, strict=True))
        print(f"  median of per-round ratios: wall {paired:.2f}x   CPU time {cpu:.2f}x")
    for label, c, w in zip(("best", "median"), *map(best_and_median, (cold, cached)), strict=True):
        print(
            f"TTFT {args.ttft_prompt} tokens ({label:6})  cold {c * 1000:7.1f} ms   "
            f"90% cached {w * 1000:7.1f} ms   ratio {w / c:.3f}"
        )


if __name__ == "__main__":
    main()
