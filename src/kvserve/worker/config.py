"""Settings of one worker process, as given on the ``kvserve worker`` command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeGuard, get_args

from kvserve.core.client_limits import ClientLimits
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.engine.kv_tier_config import KVTierConfig

Role = Literal["mixed", "prefill", "decode"]
Runner = Literal["model", "sim"]  # sim: the cost-model runner, no weights
KVTransfer = Literal["tcp", "mooncake"]  # mooncake: the kvserve[mooncake] extra
# PD peers on one host: the built-in transfer's bytes through shared memory or the socket
SameHostTransfer = Literal["shm", "socket"]


def is_role(value: str) -> TypeGuard[Role]:
    return value in get_args(Role)


def is_runner(value: str) -> TypeGuard[Runner]:
    return value in get_args(Runner)


def is_kv_transfer(value: str) -> TypeGuard[KVTransfer]:
    return value in get_args(KVTransfer)


def is_same_host_transfer(value: str) -> TypeGuard[SameHostTransfer]:
    return value in get_args(SameHostTransfer)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 8001
    role: Role = "mixed"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_batched_tokens: int = 512
    api_key: str | None = None  # required on every route but /health (see worker.api_key)
    metrics_without_key: bool = False  # /metrics open too, for a scraper without credentials
    worker_id: str | None = None
    model_name: str | None = None
    # Prompts of 100k+ tokens as JSON token ids are under 1 MiB; 8 MiB leaves margin.
    max_body_bytes: int = 8 * 1024 * 1024
    # Slow, stalled and greedy clients (see kvserve.core.client_limits).
    client_limits: ClientLimits = field(default_factory=ClientLimits)
    # On SIGTERM in-flight requests get this long to finish before they are aborted.
    shutdown_timeout_s: float = 30.0
    device: str | None = None
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (by checkpoint and device)
    threads: int | None = None  # torch intra-op threads; None: every CPU the process may use
    runner: Runner = "model"
    sim_profile: str = "llama3-8b-h100"  # kvserve.core.cost_model profile for runner "sim"
    pd: PDConfig = field(default_factory=PDConfig)  # prefill and decode roles only
    kv_tiers: KVTierConfig = field(default_factory=KVTierConfig)  # host and storage tiers
    kv_transfer: KVTransfer = "tcp"  # how PD blocks travel: built-in TCP or Mooncake's engine
    kv_transfer_same_host: SameHostTransfer = "shm"  # worker/shm_landing.py
    # KV events on ZMQ in vLLM's format too (worker/vllm_kv_publisher.py), and its replay
    kv_events_publisher: str | None = None
    kv_events_replay: str | None = None

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.host}:{self.port}"
