"""Where the model runs and in which dtype, when the caller does not say.

CPU kernels for bf16/fp16 are slow and lose accuracy against the float32 oracle, so CPU
runs in float32; CUDA runs the checkpoint's own dtype (as its authors intended).
"""

from __future__ import annotations

import torch

from kvserve.model_folder.config import ModelConfig
from kvserve.model_folder.errors import ModelLoadError

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def pick_device(requested: str | None) -> torch.device:
    if requested is not None:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(
    config: ModelConfig, device: torch.device, requested: torch.dtype | None
) -> torch.dtype:
    if requested is not None:
        return requested
    if device.type == "cpu":
        return torch.float32
    try:
        return _DTYPES[config.dtype]
    except KeyError:
        raise ModelLoadError(f"unsupported checkpoint dtype {config.dtype!r}") from None
