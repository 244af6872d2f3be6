"""How a worker's KV tiers are set up (no torch: the worker's command line builds it)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.storage.base import DEFAULT_FILE_STORAGE_BYTES


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    host_blocks: int = 0  # blocks of host memory (0: no host tier)
    host_memory: int = 0  # or bytes of host memory, made into blocks of the model's layout
    storage: str | None = None  # "file:DIR" | "redis://host:port" (None: no storage tier)
    storage_max_bytes: int = DEFAULT_FILE_STORAGE_BYTES  # bound of the file backend
    # the store's name for the router, where its location alone does not say which
    # workers share it (engine/storage/identity.py); None: from the URL
    storage_id: str | None = None
    write_policy: str = "write_through"  # to storage: "write_through" | "hit_count:K"
    max_pending_writes: int = 1024  # blocks queued for storage before writes are dropped

    def __post_init__(self) -> None:
        if self.host_blocks < 0 or self.host_memory < 0:
            raise ValueError("host_blocks and host_memory must be >= 0")
        if self.host_blocks and self.host_memory:
            raise ValueError("give host_blocks or host_memory, not both")
        if self.max_pending_writes < 1:
            raise ValueError("max_pending_writes must be >= 1")
        self.min_hits  # noqa: B018 - validates the policy now, not at the first write

    @property
    def min_hits(self) -> int:
        """Admissions that must find a block before it is written to storage (0: all)."""
        if self.write_policy == "write_through":
            return 0
        count = self.write_policy.removeprefix("hit_count:")
        if count != self.write_policy and count.isdigit() and int(count) >= 1:
            return int(count)
        raise ValueError(
            f"unknown storage write policy {self.write_policy!r}: use write_through or "
            "hit_count:K (K >= 1)"
        )

    @property
    def enabled(self) -> bool:
        return bool(self.host_blocks or self.host_memory or self.storage)

    def host_blocks_for(self, block_nbytes: int) -> int:
        """Host tier capacity in blocks of ``block_nbytes`` bytes."""
        return self.host_blocks or self.host_memory // block_nbytes
