"""The tiers' exact, cumulative counters, kept by the admission and offload parts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TierStats:
    """Exact, cumulative counters (tokens are block tokens)."""

    host_hit_tokens: int = 0  # installed from host memory
    storage_hit_tokens: int = 0  # installed from the storage tier
    storage_lookups: int = 0  # admissions that asked the storage tier
    loads_without_room: int = 0  # admitted before loaded blocks could be installed
    resumed_reused_tokens: int = 0  # of preempted requests: not recomputed on resume
    resumed_loaded_tokens: int = 0  # of those, loaded from host or storage
    resumed_recomputed_tokens: int = 0  # computed before preemption, computed again
