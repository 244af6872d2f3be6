"""Model implementations by the ``architectures`` name in ``config.json``."""

from __future__ import annotations

from kvserve.engine.models.llama import LlamaFamilyModel
from kvserve.model_folder.config import SUPPORTED_ARCHITECTURES

# Every supported architecture is a Llama-family decoder; flags carry the differences.
MODEL_CLASSES: dict[str, type[LlamaFamilyModel]] = dict.fromkeys(
    SUPPORTED_ARCHITECTURES, LlamaFamilyModel
)
