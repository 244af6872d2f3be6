"""ModelRunner against the transformers oracle, loaded from the same tiny model folders."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.engine import paged_kernel
from kvserve.engine.decode_rows import DecodeRows
from kvserve.engine.model_runner import ModelRunner, SequenceBatchItem
from kvserve.engine.tiny_model import ARCHES
from kvserve.model_folder.tokenizer import Tokenizer

BLOCK_SIZE = 4
NUM_BLOCKS = 96
PROMPTS = (
    "The quick brown fox jumps over the lazy dog. Hello! How are you today?",
    "A cache keeps what was computed",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100",
    "Émile visited São Paulo and Zürich; café 😀",
)


@cache
def oracle(model_dir: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(model_dir: Path, dtype: torch.dtype, device: str) -> AutoModelForCausalLM:
    """transformers' model in ``dtype`` on ``device`` (the float32 CPU one is cached)."""
    if dtype == torch.float32 and device == "cpu":
        return oracle(model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def oracle_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position: ``[len(token_ids), vocab]``."""
    with torch.no_grad():
        return oracle(model_dir)(torch.tensor([token_ids])).logits[0]


def assert_close_logits(ours: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def shuffled_blocks(count: int, seed: int) -> list[int]:
    """Non-contiguous, out-of-order block ids, as a long-running cache hands them out."""
    return random.Random(seed).sample(range(NUM_BLOCKS), count)


@pytest.fixture(scope="module")
def runners(tiny_model_dirs: dict[str, Path], attention_path: str) -> dict[str, ModelRunner]:
    return {
        arch: ModelRunner(path, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32)
        for arch, path in tiny_model_dirs.items()
    }


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {arch: Tokenizer(path) for arch, path in tiny_model_dirs.items()}


@pytest.mark.parametrize("arch", ARCHES)
def test_full_prompt_logits_match_oracle(arch, runners, tokenizers, tiny_model_dirs):
    ids = tokenizers[arch].encode(PROMPTS[0])
    logits = runners[arch].forward([SequenceBatchItem(ids, 0, shuffled_blocks(32, seed=1))])
    assert logits.dtype == torch.float32
    assert logits.shape == (1, runners[arch].config.vocab_size)
    assert_close_logits(logits[0], oracle_logits(tiny_model_dirs[arch], ids)[-1])


@pytest.mark.parametrize("arch", ARCHES)
def test_prompt_in_two_chunks_reuses_paged_kv(arch, runners, tokenizers, tiny_model_dirs):
    ids = tokenizers[arch].encode(PROMPTS[0])
    table = shuffled_blocks(32, seed=2)
    split = 7  # not on a block boundary: the second chunk starts mid-block
    runner = runners[arch]
    first = runner.forward([SequenceBatchItem(ids[:split], 0, table)])
    second = runner.forward([SequenceBatchItem(ids[split:], split, table)])
    reference = oracle_logits(tiny_model_dirs[arch], ids)
    assert_close_logits(first[0], reference[split - 1])
    assert_close_logits(second[0], reference[-1])


@pytest.mark.parametrize("arch", ARCHES)
def test_batched_decode_and_prefill_in_one_step(arch, runners, tokenizers, tiny_model_dirs):
    """Sequences of different lengths decode together, while another sequence prefills."""
    runner, tokenizer = runners[arch], tokenizers[arch]
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    blocks = shuffled_blocks(NUM_BLOCKS, seed=3)
    tables = [blocks[i * 24 : (i + 1) * 24] for i in range(len(prompts))]
    decoders = range(len(prompts) - 1)
    runner.forward([SequenceBatchItem(prompts[i][:-1], 0, tables[i]) for i in decoders])
    newcomer = len(prompts) - 1
    batch = [SequenceBatchItem(prompts[i][-1:], len(prompts[i]) - 1, tables[i]) for i in decoders]
    batch.append(SequenceBatchItem(prompts[newcomer], 0, tables[newcomer]))
    logits = runner.forward(batch)
    for row, ids in enumerate(prompts):
        assert_close_logits(logits[row], oracle_logits(tiny_model_dirs[arch], ids)[-1])


@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_decode_equals_generate(arch, runners, tokenizers, tiny_model_dirs):
    runner, tokenizer = runners[arch], tokenizers[arch]
    ids = tokenizer.encode_chat([{"role": "user", "content": "Please write a short poem."}])
    model = oracle(tiny_model_dirs[arch])
    prompt = torch.tensor([ids])
    with torch.no_grad():
        expected = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),  # else pad-id guessing may mask the BOS
            do_sample=False,
            max_new_tokens=20,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    table = shuffled_blocks(16, seed=4)
    generated: list[int] = []
    step_tokens, start = ids, 0
    while len(generated) < 20:
        item = SequenceBatchItem(step_tokens, start, table, sequence_key="poem")
        token = int(runner.forward([item])[0].argmax())
        generated.append(token)
        if token in tokenizer.eos_token_ids:
            break
        start, step_tokens = start + len(step_tokens), [token]
    assert generated == expected


def test_half_precision_path_stays_close_to_float32(tiny_model_dirs, tokenizers):
    """bf16 is what CUDA runs by default; the same code path runs here on CPU."""
    folder, tokenizer = tiny_model_dirs["qwen3"], tokenizers["qwen3"]
    prompts = [tokenizer.encode(text) for text in PROMPTS[:2]]
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = ModelRunner(folder, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=dtype)
        assert runner.kv_pool.layer(0).dtype == dtype
        tables = [shuffled_blocks(24, seed=5), shuffled_blocks(24, seed=6)]
        runner.forward([SequenceBatchItem(prompts[0][:-1], 0, tables[0])])
        outputs[dtype] = runner.forward(
            [
                SequenceBatchItem(prompts[0][-1:], len(prompts[0]) - 1, tables[0]),
                SequenceBatchItem(prompts[1], 0, tables[1]),
            ]
        )
    assert outputs[torch.bfloat16].dtype == torch.float32
    torch.testing.assert_close(outputs[torch.bfloat16], outputs[torch.float32], atol=0.1, rtol=0.05)
    assert torch.equal(outputs[torch.bfloat16].argmax(-1), outputs[torch.float32].argmax(-1))


@pytest.mark.parametrize(
    "rows_memory", ["kernel", None, 0], ids=["paged kernel", "decode rows", "gathered blocks"]
)
def test_decodes_of_sequences_that_come_and_go(
    rows_memory, tiny_model_dirs, tokenizers, monkeypatch
):
    """Decode rows are kept, moved down when earlier sequences leave, and refilled when a
    key shows up at a position its row does not expect (another sequence reusing it);
    with no memory for rows, decodes attend over gathered blocks; the paged kernel needs
    no rows. Logits match the oracle at every step."""
    folder, tokenizer = tiny_model_dirs["llama"], tokenizers["llama"]
    monkeypatch.setenv(paged_kernel.ENV_SWITCH, "1" if rows_memory == "kernel" else "0")
    runner = ModelRunner(folder, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32)
    if isinstance(rows_memory, int):
        runner.decode_rows = DecodeRows(runner.kv_pool, max_bytes=rows_memory)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    blocks = shuffled_blocks(NUM_BLOCKS, seed=7)
    tables = [blocks[i * 24 : (i + 1) * 24] for i in range(len(prompts))]
    references = [oracle_logits(folder, ids) for ids in prompts]

    def step(*decodes: tuple[int, int, str]) -> None:
        """Each (sequence, position from the end, key) computes that position's token."""
        batch = [
            SequenceBatchItem([prompts[i][p]], len(prompts[i]) + p, tables[i], sequence_key=key)
            for i, p, key in decodes
        ]
        for logits, (i, p, _) in zip(runner.forward(batch), decodes, strict=True):
            assert_close_logits(logits, references[i][p])

    runner.forward([SequenceBatchItem(ids[:-3], 0, tables[i]) for i, ids in enumerate(prompts)])
    step((0, -3, "a"), (1, -3, "b"), (2, -3, "c"), (3, -3, "d"))
    step((2, -2, "c"), (3, -2, "d"))  # a and b leave: the rows of c and d move down
    step((3, -1, "d"), (1, -2, "c"), (0, -2, "a"))  # key c now names sequence 1; a returns
    uses_rows = rows_memory is None or (rows_memory == "kernel" and not paged_kernel.load())
    assert (runner.decode_rows.row_capacity > 0) == uses_rows


@pytest.mark.parametrize("num_resumed", [2, 6], ids=["alone", "one padded group"])
def test_prefill_chunks_grouped_any_way_give_their_own_logits(num_resumed, runners):
    """Chunks resuming cached sequences (each alone, or many in one padded group), next to
    prompts from position 0 (equal lengths batched): each sequence's logits are what it
    gets when computed by itself."""
    runner, rng = runners["qwen2"], random.Random(8)
    prompts = [[rng.randrange(10, 900) for _ in range(rng.randint(12, 30))] for _ in range(8)]
    prompts[-1] = prompts[-2][::-1]  # two equal-length prompts from position 0
    blocks = shuffled_blocks(NUM_BLOCKS, seed=9)
    tables = [blocks[i * 12 : (i + 1) * 12] for i in range(len(prompts))]
    alone = [runner.forward([SequenceBatchItem(p, 0, tables[i])])[0] for i, p in enumerate(prompts)]
    resumed = range(num_resumed)
    runner.forward([SequenceBatchItem(prompts[i][:5], 0, tables[i]) for i in resumed])
    batch = [SequenceBatchItem(prompts[i][5:], 5, tables[i]) for i in resumed]
    batch += [SequenceBatchItem(prompts[i], 0, tables[i]) for i in range(num_resumed, 8)]
    for ours, reference in zip(runner.forward(batch), alone, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHES)
def test_bfloat16_is_as_close_to_float32_as_transformers_in_bfloat16(
    arch, tiny_model_dirs, attention_path, device
):
    """bf16 cannot match float32 exactly (8-bit mantissas; greedy choices between near-tied
    logits flip), so its tolerance is transformers' own: against transformers in float32,
    our bf16 logits (prefill chunk, then decodes) may be off by no more than transformers
    in bf16 is on the same tokens, with a 1.5x margin for summation order."""
    folder, rng = tiny_model_dirs[arch], random.Random(3)
    tokens = [rng.randrange(10, 900) for _ in range(60)]
    ids = torch.tensor([tokens], device=device)
    with torch.no_grad():
        exact = reference(folder, torch.float32, device)(ids).logits[0, 40:].cpu()
        theirs = reference(folder, torch.bfloat16, device)(ids).logits[0, 40:].cpu()
    runner = ModelRunner(
        folder, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.bfloat16, device=device
    )
    table = shuffled_blocks(16, seed=4)
    first = runner.forward([SequenceBatchItem(tokens[:41], 0, table)])
    rest = [
        runner.forward([SequenceBatchItem([t], p, table)]) for p, t in enumerate(tokens) if p > 40
    ]
    ours = torch.cat([first, *rest]).float().cpu()
    our_error, their_error = (ours - exact).abs(), (theirs.float() - exact).abs()
    assert our_error.max() <= 1.5 * their_error.max()
    assert our_error.mean() <= 1.5 * their_error.mean()
