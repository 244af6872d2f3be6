"""kvserve: KV-cache-centric LLM serving.

``LLM`` and ``SamplingParams`` are imported lazily so that ``import kvserve`` (the
router, the simulator, the bench) never pulls in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvserve.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
