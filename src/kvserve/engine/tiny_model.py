"""Deterministic tiny random-weight model folders, so everything runs with no download.

A folder is a real Hugging Face checkpoint in miniature: ``config.json`` as each family
writes it, bf16 ``model.safetensors`` (``torch_dtype`` float32 by default, so engines run
them in float32 and match the float32 oracle exactly; ``bfloat16`` to exercise the bf16
default a checkpoint of that dtype gets), a byte-level BPE ``tokenizer.json`` trained here on
an embedded English corpus, ``tokenizer_config.json`` with the family's chat format, and
``generation_config.json``. ``transformers`` loads it, which is what the oracle tests need.
Weights are scaled so that logits are well spread: greedy choices then do not hinge on
float rounding, and agreement with the oracle is a meaningful check.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

ARCHES = ("llama", "qwen2", "qwen3")
_VOCAB_SIZE = 1024

_PROSE = """\
The quick brown fox jumps over the lazy dog. A cache keeps what was computed so that the
next request does not pay for it again. When many users ask questions that share a long
system prompt, the server can compute that prefix once and reuse it for everyone.
Hello! How are you today? I am fine, thank you. What would you like to know?
Please write a short poem about the sea, the wind and the morning light.
The weather in the city was cold and grey, but the market was full of people.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 1,000,000.
Code: def add(a, b): return a + b  # adds two numbers
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
Émile visited São Paulo and Zürich; café, naïve, résumé — “quoted” text… 日本語 😀.
"""

_SUBJECTS = (
    "a quiet neighbour",
    "the brave pilot",
    "his grandmother",
    "the young doctor",
    "a tired musician",
    "the village baker",
    "our new manager",
    "the hungry children",
    "the model",
    "a server",
    "the router",
    "my friend",
    "the teacher",
    "a small robot",
    "the old library",
    "our team",
    "the student",
    "a curious cat",
    "the scheduler",
    "the engineer",
    "every worker",
    "the assistant",
    "this program",
)
_VERBS = (
    "carries",
    "paints",
    "describes",
    "discovers",
    "repairs",
    "cooks",
    "borrows",
    "imagines",
    "chooses",
    "collects",
    "follows",
    "celebrates",
    "questions",
    "protects",
    "teaches",
    "reads",
    "writes",
    "remembers",
    "forgets",
    "sends",
    "receives",
    "builds",
    "explains",
    "answers",
    "computes",
    "stores",
    "finds",
    "loves",
    "watches",
    "measures",
    "shares",
)
_OBJECTS = (
    "a wooden chair",
    "the broken window",
    "several strange photographs",
    "warm bread",
    "the mountain path",
    "a difficult puzzle",
    "the ancient castle",
    "fresh vegetables",
    "the yellow umbrella",
    "an important message",
    "the kitchen table",
    "bright flowers",
    "a long story",
    "the answer",
    "every question",
    "the blue book",
    "many tokens",
    "a cached prefix",
    "the results",
    "a simple recipe",
    "the train schedule",
    "some music",
    "a friendly letter",
    "the evening news",
    "three apples",
    "the map",
)
_ENDINGS = (
    "during the holiday",
    "under the bridge",
    "near the river",
    "behind the school",
    "because it was late",
    "while everyone slept",
    "through the forest",
    "across town",
    "before lunch",
    "after the rain",
    "very quickly",
    "with great care",
    "in the garden",
    "at night",
    "without a word",
    "for the first time",
    "again and again",
    "on Monday",
)


@dataclass(frozen=True, slots=True)
class _Family:
    architecture: str
    model_type: str
    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str  # the end-of-turn token: what the chat template ends a message with
    extra_eos: str  # the end-of-text token, also a stop for generation
    chat_template: str
    num_layers: int
    head_dim: int
    tied: bool
    rope: dict[str, Any]


_LLAMA_TEMPLATE = """\
{{- bos_token }}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none %}
{%- if system is not none or tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if system is not none %}{{ system | trim }}{% endif %}
{%- if tools %}
{{- '\\n\\nYou can call these functions. Reply with JSON {"name": ..., "arguments": ...}.' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages if message.role != 'system' %}
{%- set role = 'ipython' if message.role == 'tool' else message.role %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
{%- endfor %}
{%- else %}
{{- message.content | trim }}
{%- endif %}
{{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

_CHATML_TEMPLATE = """\
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if has_system or tools %}
{{- '<|im_start|>system\\n' }}
{%- if has_system %}{{ messages[0].content }}{% endif %}
{%- if tools %}
{{- '\\n\\n# Tools\\nCall a function by replying with <tool_call>{"name": ..., \
"arguments": ...}</tool_call>. Available functions:' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages if message.role != 'system' %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
{{- '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments} \
| tojson) + '</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _chatml_family(
    architecture: str, model_type: str, *, num_layers: int, head_dim: int
) -> _Family:
    """Qwen's chat format and stops; tied embeddings as in the small Qwen checkpoints."""
    return _Family(
        architecture=architecture,
        model_type=model_type,
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        extra_eos="<|endoftext|>",
        chat_template=_CHATML_TEMPLATE,
        num_layers=num_layers,
        head_dim=head_dim,
        tied=True,
        rope={"rope_theta": 1000000.0},
    )


_FAMILIES = {
    "llama": _Family(
        architecture="LlamaForCausalLM",
        model_type="llama",
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        extra_eos="<|end_of_text|>",
        chat_template=_LLAMA_TEMPLATE,
        num_layers=4,
        head_dim=16,
        tied=False,
        rope={
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        },
    ),
    "qwen2": _chatml_family("Qwen2ForCausalLM", "qwen2", num_layers=2, head_dim=16),
    # Qwen3 decouples head_dim from hidden_size / heads.
    "qwen3": _chatml_family("Qwen3ForCausalLM", "qwen3", num_layers=3, head_dim=32),
}

_MAX_POSITIONS = 4096


@dataclass(frozen=True, slots=True)
class TinyShape:
    """Widths of a generated model. The defaults keep test models a few MB; benchmarks
    widen them to realistic sizes (kernel speed is only meaningful on realistic widths).
    ``None`` fields take the family's own value."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    num_layers: int | None = None
    head_dim: int | None = None

    def check(self) -> None:
        sizes = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "num_layers": self.num_layers or 1,
            "head_dim": self.head_dim or 2,
        }
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not share {self.num_kv_heads} KV heads")
        if (self.head_dim or 2) % 2:
            raise ValueError(f"head_dim must be even (rotary pairs), got {self.head_dim}")


def training_corpus() -> list[str]:
    """The embedded prose plus sentences from a fixed-seed grammar, for enough merges."""
    rng = random.Random(0)
    lines = _PROSE.splitlines()
    for _ in range(1500):
        sentence = " ".join(
            (rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_ENDINGS))
        )
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice(".!?"))
    return lines


def _train_tokenizer(family: _Family) -> HFTokenizer:
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(family.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    if family.bos is None:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tokenizer.token_to_id(family.bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A",
            pair=f"{family.bos} $A {family.bos} $B",
            special_tokens=[(family.bos, bos_id)],
        )
    return tokenizer


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    def norm_weight(size: int) -> torch.Tensor:
        return (1.0 + torch.randn(size, generator=generator) * 0.1).to(torch.bfloat16)

    def linear(out_dim: int, in_dim: int) -> torch.Tensor:
        return normal(out_dim, in_dim, std=in_dim**-0.5)

    hidden, vocab, head_dim = config["hidden_size"], config["vocab_size"], config["head_dim"]
    inter, model_type = config["intermediate_size"], config["model_type"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    # Small embeddings keep the residual stream from echoing the input token (which, with
    # tied embeddings, makes every model repeat one token).
    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=0.1)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm_weight(hidden),
            p + "self_attn.q_proj.weight": linear(q_size, hidden),
            p + "self_attn.k_proj.weight": linear(kv_size, hidden),
            p + "self_attn.v_proj.weight": linear(kv_size, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, q_size),
            p + "post_attention_layernorm.weight": norm_weight(hidden),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
        }
        if model_type == "qwen2":
            for name, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
                weights[f"{p}self_attn.{name}.bias"] = normal(size, std=0.1)
        if model_type == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = norm_weight(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm_weight(head_dim)
    weights["model.norm.weight"] = norm_weight(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(vocab, hidden)
    return weights


def _model_config(
    family: _Family, shape: TinyShape, tokenizer: HFTokenizer, dtype: str
) -> dict[str, Any]:
    token_id = tokenizer.token_to_id
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers or family.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim or family.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": family.tied,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_id(family.bos) if family.bos else None,
        "eos_token_id": token_id(family.eos),
        "torch_dtype": dtype,
        "use_cache": True,
        **family.rope,
    }
    if family.model_type != "llama":
        config |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 0}
    return config


def _tokenizer_config(family: _Family) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": family.bos,
        "eos_token": family.eos,
        "pad_token": family.extra_eos,
        "model_max_length": _MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": family.chat_template,
    }


def make_tiny_model(
    model_dir: str | Path,
    arch: str,
    seed: int = 0,
    shape: TinyShape | None = None,
    dtype: str = "float32",
) -> Path:
    """Write the folder (created if needed) and return its path; same inputs, same bytes.
    ``dtype``: the checkpoint dtype its config declares (the weights file is bf16 either
    way: every value is bf16-exact)."""
    if arch not in _FAMILIES:
        raise ValueError(f"unknown tiny model arch {arch!r}; choose one of {', '.join(ARCHES)}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"tiny models declare float32 or bfloat16, not {dtype!r}")
    family = _FAMILIES[arch]
    shape = shape or TinyShape()
    shape.check()
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(family)
    config = _model_config(family, shape, tokenizer, dtype)
    eos_ids = [tokenizer.token_to_id(family.eos), tokenizer.token_to_id(family.extra_eos)]
    generation_config = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids}
    files = {
        "config.json": config,
        "generation_config.json": generation_config,
        "tokenizer_config.json": _tokenizer_config(family),
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", "utf-8")
    tokenizer.save(str(out / "tokenizer.json"))
    save_file(
        _random_weights(config, seed),
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out
