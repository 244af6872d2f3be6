"""Loading variants of the tiny models (sharded, Mistral, windows, RoPE scalings) against the
transformers oracle, and the one-line errors of broken folders and bad batches."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvserve.engine.model_runner import ModelRunner, SequenceBatchItem
from kvserve.model_folder.errors import ModelLoadError

TOKENS = list(range(5, 45))  # 40 tokens: longer than the test windows and several blocks


def variant(source: Path, target: Path, **config_changes) -> Path:
    """A copy of a model folder with config.json fields changed (None deletes a field)."""
    shutil.copytree(source, target)
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config.update(config_changes)
    config = {key: value for key, value in config.items() if value is not None}
    config_path.write_text(json.dumps(config))
    return target


def runner_logits(folder: Path, tokens: list[int] = TOKENS) -> torch.Tensor:
    runner = ModelRunner(folder, num_blocks=16, block_size=4, dtype=torch.float32)
    return runner.forward([SequenceBatchItem(tokens, 0, list(range(15, 5, -1)))])[0]


def assert_matches_oracle(folder: Path) -> None:
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        expected = model(torch.tensor([TOKENS])).logits[0, -1]
    ours = runner_logits(folder)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert ours.argmax() == expected.argmax()


def test_sharded_checkpoint_gives_the_same_logits(tiny_model_dirs, tmp_path):
    folder = variant(tiny_model_dirs["llama"], tmp_path / "sharded")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, members in shards.items():
        save_file({name: tensors[name] for name in members}, folder / file)
        weight_map |= dict.fromkeys(members, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.testing.assert_close(runner_logits(folder), runner_logits(tiny_model_dirs["llama"]))
    assert_matches_oracle(folder)


@pytest.mark.parametrize(
    ("arch", "changes"),
    [
        (
            "llama",
            {
                "architectures": ["MistralForCausalLM"],
                "model_type": "mistral",
                "rope_scaling": None,
                "sliding_window": 8,
            },
        ),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        (
            "qwen2",
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
        (
            "llama",
            {
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "attention_bias": False,
                "tie_word_embeddings": True,
            },
        ),
    ],
    ids=[
        "mistral-sliding",
        "qwen3-sliding",
        "qwen2-yarn",
        "llama-linear-tie-flag-with-own-lm-head",
    ],
)
def test_family_variants_match_oracle(arch, changes, tiny_model_dirs, tmp_path):
    assert_matches_oracle(variant(tiny_model_dirs[arch], tmp_path / "m", **changes))


def test_missing_weights_are_named(tiny_model_dirs, tmp_path):
    folder = variant(tiny_model_dirs["qwen2"], tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        ModelRunner(folder, num_blocks=4, block_size=4)


def test_missing_tensor_is_named(tiny_model_dirs, tmp_path):
    folder = variant(tiny_model_dirs["qwen3"], tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm"
    ):
        ModelRunner(folder, num_blocks=4, block_size=4)


def test_untied_model_without_lm_head_is_named(tiny_model_dirs, tmp_path):
    folder = variant(tiny_model_dirs["qwen2"], tmp_path / "m", tie_word_embeddings=False)
    with pytest.raises(ModelLoadError, match=r"missing tensor 'lm_head\.weight'"):
        ModelRunner(folder, num_blocks=4, block_size=4)


def test_shape_mismatch_is_named(tiny_model_dirs, tmp_path):
    folder = variant(tiny_model_dirs["qwen2"], tmp_path / "m", intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"mlp\.gate_proj\.weight' has shape \(128, 64\)"):
        ModelRunner(folder, num_blocks=4, block_size=4)


def test_corrupt_weights_and_missing_shard_are_named(tiny_model_dirs, tmp_path):
    folder = variant(tiny_model_dirs["qwen2"], tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ModelLoadError, match="unreadable weights file"):
        ModelRunner(folder, num_blocks=4, block_size=4)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"shard model-00001-of-00001\.safetensors"):
        ModelRunner(folder, num_blocks=4, block_size=4)


def test_unsupported_architecture_is_named(tiny_model_dirs, tmp_path):
    folder = variant(tiny_model_dirs["qwen2"], tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \(GPT2LMHeadModel\)"):
        ModelRunner(folder, num_blocks=4, block_size=4)


@pytest.fixture(scope="module")
def small_runner(tiny_model_dirs) -> ModelRunner:
    return ModelRunner(tiny_model_dirs["qwen2"], num_blocks=8, block_size=4)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ([], "at least one sequence"),
        ([SequenceBatchItem([], 0, [0])], "bad batch item"),
        ([SequenceBatchItem([1] * 9, 0, [0, 1])], "block table has 2 blocks, 3 needed"),
        ([SequenceBatchItem([1], 0, [8])], r"block id out of range \[0, 8\)"),
        ([SequenceBatchItem([10**6], 0, [0])], "token id out of range"),
    ],
)
def test_bad_batches_are_refused_before_touching_the_cache(small_runner, batch, message):
    before = small_runner.kv_pool.layer(0).clone()
    with pytest.raises(ValueError, match=message):
        small_runner.forward(batch)
    assert torch.equal(small_runner.kv_pool.layer(0), before)


def test_blocks_for_memory(small_runner):
    config = small_runner.config
    per_block = 2 * config.num_layers * 4 * config.num_kv_heads * config.head_dim * 4
    assert ModelRunner.blocks_for_memory(config, 4, 10 * per_block + 1, torch.float32) == 10
    assert ModelRunner.blocks_for_memory(config, 4, 10 * per_block, torch.bfloat16) == 20
