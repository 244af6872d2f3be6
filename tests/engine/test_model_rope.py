"""RoPE tables: every scaling type equals transformers' own initialisation, and the table
grows past its first size without changing a value."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvserve.engine.models.rope import RotaryTable, apply_rotary, inverse_frequencies
from kvserve.model_folder.config import ModelConfig

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
    },
}
SIZES = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 4096}


@pytest.mark.parametrize("name", SCALINGS)
def test_inverse_frequencies_equal_transformers(name):
    scaling = SCALINGS[name]
    hf_config = LlamaConfig(**SIZES, rope_theta=50000.0, rope_scaling=dict(scaling))
    expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    ours = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            **SIZES,
            "rope_theta": 50000.0,
            "rope_scaling": scaling,
        }
    )
    inv_freq, factor = inverse_frequencies(ours.rope, ours.head_dim)
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor)


def test_table_grows_without_changing_values():
    rope = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            **SIZES,
        }
    ).rope
    small = RotaryTable(
        rope, 64, dtype=torch.float32, device=torch.device("cpu"), initial_positions=8
    )
    large = RotaryTable(
        rope, 64, dtype=torch.float32, device=torch.device("cpu"), initial_positions=5000
    )
    positions = torch.tensor([0, 7, 8, 300, 4999])
    for got, want in zip(small.lookup(positions, 4999), large.lookup(positions, 4999), strict=True):
        assert torch.equal(got, want)


def test_rotation_is_the_half_split_convention():
    x = torch.randn(3, 2, 8)
    angles = torch.randn(3, 1, 4)
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), -1)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)
    torch.testing.assert_close(apply_rotary(x, cos, signed_sin), x * cos + rotate_half * sin)
