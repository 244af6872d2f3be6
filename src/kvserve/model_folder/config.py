"""What the engine needs to know about a Hugging Face model folder, read from ``config.json``.

Torch-free on purpose: the router reads the same folder (tokenizer, chat template, EOS ids)
without installing torch. Architecture knowledge that changes the weights' layout (biases,
q/k norm) is resolved here into plain flags, so the model code has no per-family branches
on names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.model_folder.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class FamilyFlags:
    """How one architecture differs from plain Llama."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool


def _llama_flags(raw: dict[str, Any]) -> FamilyFlags:
    bias = bool(raw.get("attention_bias", False))
    return FamilyFlags(qkv_bias=bias, o_bias=bias, qk_norm=False)


def _qwen2_flags(raw: dict[str, Any]) -> FamilyFlags:
    return FamilyFlags(qkv_bias=True, o_bias=False, qk_norm=False)


def _qwen3_flags(raw: dict[str, Any]) -> FamilyFlags:
    bias = bool(raw.get("attention_bias", False))
    return FamilyFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)


_FAMILIES = {
    "LlamaForCausalLM": _llama_flags,
    "MistralForCausalLM": _llama_flags,
    "Qwen2ForCausalLM": _qwen2_flags,
    "Qwen3ForCausalLM": _qwen3_flags,
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)

_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """RoPE as the config states it; ``params`` holds the scaling type's own keys."""

    theta: float
    rope_type: str = "default"
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mlp_bias: bool
    flags: FamilyFlags
    rope: RopeConfig
    # Per layer: the sliding attention window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...]
    # The checkpoint's dtype name ("bfloat16", "float32", ...), as the config states it.
    dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        return cls.from_dict(read_json(path, what="config.json"), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        architecture = _architecture(raw, source)
        try:
            return _parse(raw, architecture, source)
        except KeyError as missing:
            raise ModelLoadError(f"{source}: missing field {missing}") from None
        except (TypeError, ValueError) as bad:
            if isinstance(bad, ModelLoadError):
                raise
            raise ModelLoadError(f"{source}: malformed field ({bad})") from None


def read_json(path: Path, *, what: str) -> dict[str, Any]:
    """A JSON object from the model folder, or a one-line error naming the file."""
    if not path.is_file():
        raise ModelLoadError(f"{what} not found in model folder {path.parent}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{path}: unreadable JSON ({err})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def token_id_list(value: Any) -> tuple[int, ...]:
    """HF writes an id field as an int, a list of ints, or null."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _architecture(raw: dict[str, Any], source: str) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in _FAMILIES:
            return str(name)
    shown = ", ".join(names) if names else "none given"
    raise ModelLoadError(
        f"{source}: unsupported architecture ({shown}); supported: "
        + ", ".join(SUPPORTED_ARCHITECTURES)
    )


def _parse(raw: dict[str, Any], architecture: str, source: str) -> ModelConfig:
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    num_layers = int(raw["num_hidden_layers"])
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: unsupported hidden_act {act!r} (only silu)")
    return ModelConfig(
        architecture=architecture,
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        flags=_FAMILIES[architecture](raw),
        rope=_rope(raw, source),
        sliding_windows=_sliding_windows(raw, num_layers, source),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        eos_token_ids=token_id_list(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
    )


def _rope(raw: dict[str, Any], source: str) -> RopeConfig:
    """Reads both spellings: ``rope_theta`` + ``rope_scaling`` (Hub checkpoints) and
    ``rope_parameters`` (what transformers 5 writes)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope type {rope_type!r}; supported: " + ", ".join(_ROPE_TYPES)
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor is not supported")
    if rope_type == "yarn" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = raw["max_position_embeddings"]
    return RopeConfig(theta=theta, rope_type=rope_type, params=tuple(sorted(params.items())))


def _sliding_windows(raw: dict[str, Any], num_layers: int, source: str) -> tuple[int | None, ...]:
    """Per-layer windows the way each family declares them: ``layer_types`` when written,
    else Mistral's model-wide ``sliding_window`` or Qwen's ``use_sliding_window`` with
    ``max_window_layers`` (layers at or above it slide)."""
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ModelLoadError(f"{source}: layer_types has {len(layer_types)} entries")
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if window is None:
        return (None,) * num_layers
    if raw.get("model_type") == "mistral":
        return (int(window),) * num_layers
    if not raw.get("use_sliding_window", False):
        return (None,) * num_layers
    first = int(raw.get("max_window_layers", 0))
    return tuple(int(window) if i >= first else None for i in range(num_layers))
