"""config.json parsing: both RoPE spellings, family flags, windows, one-line errors."""

from __future__ import annotations

import pytest

from kvserve.model_folder.config import ModelConfig
from kvserve.model_folder.errors import ModelLoadError

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def parse(**changes) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **changes})


def test_defaults_follow_transformers():
    config = parse()
    assert config.num_kv_heads == 4  # no GQA unless stated
    assert config.head_dim == 16
    assert config.rope.theta == 10000.0 and config.rope.rope_type == "default"
    assert config.sliding_windows == (None, None)
    assert config.eos_token_ids == ()


def test_hub_and_transformers5_rope_spellings_agree():
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hub = parse(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling})
    new = parse(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling})
    legacy = parse(rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling})
    assert hub.rope == new.rope == legacy.rope
    assert hub.rope.get("factor") == 8.0


def test_family_flags():
    qwen2 = parse(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    assert (qwen2.flags.qkv_bias, qwen2.flags.o_bias, qwen2.flags.qk_norm) == (True, False, False)
    qwen3 = parse(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32)
    assert qwen3.flags.qk_norm and qwen3.head_dim == 32
    llama_bias = parse(attention_bias=True)
    assert llama_bias.flags.qkv_bias and llama_bias.flags.o_bias


def test_sliding_windows_per_family():
    mistral = parse(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    assert mistral.sliding_windows == (8, 8)
    qwen_off = parse(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=8)
    assert qwen_off.sliding_windows == (None, None)
    qwen_on = parse(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        sliding_window=8,
        use_sliding_window=True,
        max_window_layers=1,
    )
    assert qwen_on.sliding_windows == (None, 8)
    typed = parse(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    assert typed.sliding_windows == (8, None)


def test_eos_may_be_a_list():
    assert parse(eos_token_id=[1, 2]).eos_token_ids == (1, 2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"unsupported architecture \(GPT2LMHeadModel\)"),
        ({"architectures": None}, r"unsupported architecture \(none given\)"),
        ({"vocab_size": None}, r"malformed field"),
        ({"hidden_act": "gelu"}, r"unsupported hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "longrope"}}, r"unsupported rope type 'longrope'"),
        ({"layer_types": ["full_attention"]}, r"layer_types has 1 entries"),
    ],
)
def test_errors_are_one_line_and_name_the_problem(changes, message):
    with pytest.raises(ModelLoadError, match=message) as caught:
        parse(**changes)
    assert "\n" not in str(caught.value)


def test_missing_field_is_named():
    raw = dict(BASE)
    del raw["hidden_size"]
    with pytest.raises(ModelLoadError, match="missing field 'hidden_size'"):
        ModelConfig.from_dict(raw)


def test_missing_and_broken_config_files(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="unreadable JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match="expected a JSON object"):
        ModelConfig.from_dir(tmp_path)
