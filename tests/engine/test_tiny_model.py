"""make_tiny_model: deterministic, small, loadable by transformers, reachable from the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kvserve.engine.tiny_model import TinyShape, make_tiny_model
from kvserve.model_folder.config import ModelConfig

KVSERVE = str(Path(sys.executable).parent / "kvserve")


def folder_bytes(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_same_seed_same_bytes(tmp_path, tiny_model_dirs):
    again = make_tiny_model(tmp_path / "again", "qwen3", seed=0)
    assert folder_bytes(again) == folder_bytes(tiny_model_dirs["qwen3"])


def test_other_seed_changes_weights_only(tmp_path, tiny_model_dirs):
    other = make_tiny_model(tmp_path / "other", "llama", seed=1)
    ours, theirs = folder_bytes(tiny_model_dirs["llama"]), folder_bytes(other)
    assert ours.keys() == theirs.keys()
    assert ours["model.safetensors"] != theirs["model.safetensors"]
    del ours["model.safetensors"], theirs["model.safetensors"]
    assert ours == theirs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_shape_of_the_family(arch, tiny_model_dirs):
    folder = tiny_model_dirs[arch]
    config = ModelConfig.from_dir(folder)
    assert 900 <= config.vocab_size <= 2048
    assert (config.num_heads, config.num_kv_heads, config.hidden_size) == (4, 2, 64)
    assert config.max_position_embeddings >= 4096
    assert sum(p.stat().st_size for p in folder.iterdir()) < 4_000_000
    weights = load_file(folder / "model.safetensors")
    assert ("lm_head.weight" in weights) == (not config.tie_word_embeddings)
    assert config.flags.qk_norm == (arch == "qwen3")
    assert config.flags.qkv_bias == (arch == "qwen2")
    assert (config.rope.rope_type == "llama3") == (arch == "llama")


def test_cli_writes_a_folder(tmp_path):
    result = subprocess.run(
        [KVSERVE, "make-tiny-model", str(tmp_path / "m"), "--arch", "qwen2", "--seed", "5"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]


def test_cli_rejects_an_unknown_arch(tmp_path):
    result = subprocess.run(
        [KVSERVE, "make-tiny-model", str(tmp_path / "m"), "--arch", "gpt2"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "llama, qwen2, qwen3" in result.stderr
    assert not (tmp_path / "m").exists()


def test_unknown_arch_is_refused_by_the_function(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model arch"):
        make_tiny_model(tmp_path, "gpt2")


def test_widths_reach_config_and_weights_and_transformers_loads_them(tmp_path):
    import transformers  # the dev extra's oracle, always installed for the tests

    widths = {"hidden_size": 96, "intermediate_size": 160, "num_heads": 6, "num_kv_heads": 3}
    shape = TinyShape(**widths, num_layers=2, head_dim=24)
    folder = make_tiny_model(tmp_path, "qwen3", seed=0, shape=shape)
    config = ModelConfig.from_dir(folder)
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (96, 160, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (6, 3, 24)
    weights = load_file(folder / "model.safetensors")
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (3 * 24, 96)
    assert weights["model.layers.1.mlp.down_proj.weight"].shape == (96, 160)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) == sum(w.numel() for w in weights.values())


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (TinyShape(num_heads=4, num_kv_heads=3), "do not share"),
        (TinyShape(head_dim=15), "even"),
        (TinyShape(hidden_size=0), "positive"),
    ],
)
def test_bad_widths_are_refused(tmp_path, shape, message):
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path, "llama", shape=shape)


def test_cli_width_options(tmp_path):
    result = subprocess.run(
        [
            *(KVSERVE, "make-tiny-model", str(tmp_path / "m"), "--arch", "qwen3"),
            *("--hidden-size", "128", "--num-layers", "1", "--head-dim", "64"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (128, 1, 64)
