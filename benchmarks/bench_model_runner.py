"""Batch greedy generation: ModelRunner (paged KV, block tables) vs transformers' generate.

Both produce ``--new-tokens`` greedy tokens for ``--batch`` prompts of ``--prompt-len``
random tokens on the same tiny model, measured side by side in one process (best of
``--repeats`` alternating rounds). The runner loop is the bare model step plus
argmax — the floor under any engine built on it.

    python benchmarks/bench_model_runner.py --arch llama --batch 32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from kvserve.engine.llm_engine import DEFAULT_KV_CACHE_MEMORY
from kvserve.engine.model_runner import ModelRunner, SequenceBatchItem
from kvserve.engine.tiny_model import make_tiny_model
from kvserve.model_folder.config import ModelConfig

BLOCK_SIZE = 16


def runner_generate(
    runner: ModelRunner, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    blocks_each = -(-(len(prompts[0]) + new_tokens) // BLOCK_SIZE)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(prompts))]
    logits = runner.forward(
        [SequenceBatchItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    )
    outputs = [[int(t)] for t in logits.argmax(-1)]
    for step in range(1, new_tokens):
        start = len(prompts[0]) + step - 1
        # Keys as the engine passes them: each sequence keeps its decode row across steps.
        batch = [
            SequenceBatchItem(out[-1:], start, t, sequence_key=i)
            for i, (out, t) in enumerate(zip(outputs, tables, strict=True))
        ]
        for out, token in zip(outputs, runner.forward(batch).argmax(-1).tolist(), strict=True):
            out.append(token)
    return outputs


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :].tolist()


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_model(tmp, args.arch)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        # The engine's default pool (decode rows may take a quarter of it on top).
        config = ModelConfig.from_dir(folder)
        blocks = ModelRunner.blocks_for_memory(
            config, BLOCK_SIZE, DEFAULT_KV_CACHE_MEMORY, torch.float32
        )
        runner = ModelRunner(folder, num_blocks=blocks, block_size=BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 900, (args.batch, args.prompt_len), generator=generator).tolist()
    tokens = args.batch * args.new_tokens

    ours_times, hf_times = [], []
    for _ in range(args.repeats):  # alternating, so machine noise hits both alike
        ours_s, ours_out = timed(lambda: runner_generate(runner, prompts, args.new_tokens))
        hf_s, hf_out = timed(lambda: hf_generate(model, prompts, args.new_tokens))
        ours_times.append(ours_s)
        hf_times.append(hf_s)
    ours_s, hf_s = min(ours_times), min(hf_times)
    round_ratio = statistics.median(h / o for h, o in zip(hf_times, ours_times, strict=True))
    same = sum(a == b for a, b in zip(ours_out, hf_out, strict=True))
    print(
        f"{args.arch}, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"{args.threads} thread(s)"
    )
    print(f"  transformers generate: {tokens / hf_s:9.0f} tok/s  ({hf_s * 1e3:.0f} ms)")
    print(f"  kvserve ModelRunner:   {tokens / ours_s:9.0f} tok/s  ({ours_s * 1e3:.0f} ms)")
    print(
        f"  ratio of best times: {hf_s / ours_s:.2f}x   median of round ratios: "
        f"{round_ratio:.2f}x   identical greedy outputs: {same}/{args.batch}"
    )


if __name__ == "__main__":
    main()
