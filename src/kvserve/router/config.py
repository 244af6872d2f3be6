"""Router settings and their defaults.

Retry, circuit-breaker, health-check and timeout defaults are the SGLang model gateway's
(``sglang_router.launch_router``), so the two routers behave alike out of the box.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvserve.core.client_limits import ClientLimits
from kvserve.core.routing.cache_aware import CacheAwareConfig
from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.routing.policies import POLICY_NAMES, make_policy
from kvserve.core.routing.policy import Policy
from kvserve.router.kv_event_source import KVEventSource, parse_kv_event_source

HTTP_SERVERS = ("aiohttp", "lean")


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Retries of requests that have not streamed a byte yet, on another worker if any."""

    max_retries: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 30.0
    backoff_multiplier: float = 1.5
    jitter: float = 0.2  # each delay is scaled by a random factor in [1 - jitter, 1 + jitter]


@dataclass(frozen=True, slots=True)
class CircuitBreakerConfig:
    """Consecutive failures open a worker's breaker; after ``open_s`` trial traffic flows."""

    failure_threshold: int = 10
    success_threshold: int = 3
    open_s: float = 60.0


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    interval_s: float = 60.0
    timeout_s: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    worker_urls: tuple[str, ...] = ()
    # per worker URL, by position: "kvserve" (its HTTP stream) or a ZMQ publisher in
    # vLLM's format (router/kv_event_source.py); empty: every worker's HTTP stream
    kv_events: tuple[str, ...] = ()
    kv_block_size: int | None = None  # ZMQ sources: instead of what their events say
    prefill_urls: tuple[str, ...] = ()  # PD mode (with decode_urls): see router/pd_proxy.py
    decode_urls: tuple[str, ...] = ()
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required from clients on /v1/* when set
    admin_api_key: str | None = None  # required on /workers; falls back to api_key
    worker_api_key: str | None = None  # sent on every request to a worker (their --api-key)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    kv_aware: KvAwareConfig = field(default_factory=KvAwareConfig)
    tokenizer: str | None = None  # kv_aware: model folder (default: the workers' model)
    session_header: str = "x-session-id"  # else the body's ``user`` field keys the session
    session_virtual_nodes: int = 160
    pd: PDConfig = field(default_factory=PDConfig)  # PD mode: when to prefill remotely
    retry: RetryConfig = field(default_factory=RetryConfig)
    circuit_breaker: CircuitBreakerConfig = field(default_factory=CircuitBreakerConfig)
    health: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    request_timeout_s: float = 1800.0
    max_request_bytes: int = 32 * 1024 * 1024
    client_limits: ClientLimits = field(default_factory=ClientLimits)  # slow or greedy clients
    chars_per_token: float = 4.0  # prefill estimate without a tokenizer
    seed: int | None = None  # for the random policies; None: seeded from the OS
    # Other router replicas of this fleet: announce routing to them, apply theirs
    # (router/peers.py)
    peer_urls: tuple[str, ...] = ()
    processes: int = 1  # router processes on the port (router/process_group.py)
    http_server: str = "lean"  # hot routes off aiohttp (router/lean_server.py); or "aiohttp"

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {POLICY_NAMES}")
        if self.request_timeout_s <= 0 or self.max_request_bytes <= 0:
            raise ValueError("request timeout and size limit must be positive")
        if self.prefill_urls and not self.decode_urls:
            raise ValueError("prefill workers need decode workers (--decode)")
        if self.kv_events and len(self.kv_events) != len(self.worker_urls):
            raise ValueError(
                f"{len(self.kv_events)} --kv-events for {len(self.worker_urls)} --worker-urls: "
                "give one per worker, in the same order"
            )
        self.kv_event_sources()  # raises ValueError on a malformed one
        if self.kv_block_size is not None and self.kv_block_size <= 0:
            raise ValueError("--kv-block-size must be positive")
        for url in self.peer_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--peers takes router URLs (http://host:port), got {url!r}")
        self._check_processes()
        if self.http_server not in HTTP_SERVERS:
            raise ValueError(f"--http-server is one of {HTTP_SERVERS}, got {self.http_server!r}")

    def _check_processes(self) -> None:
        """``--processes N`` needs a port every process can bind."""
        if self.processes < 1:
            raise ValueError("--processes must be at least 1")
        if self.processes > 1 and self.port == 0:
            raise ValueError("--processes > 1 needs a fixed --port (each process binds it)")
        if self.processes > 1 and self.peer_urls:
            raise ValueError(
                "--processes > 1 and --peers cannot be combined yet: run one process per "
                "replica (kvserve up --routers R), or several processes without --peers"
            )

    def replica_rank(self) -> int:
        """This replica's place (0, 1, ...) among itself and its ``--peers``, by address:
        host, then port. Replicas must name each other as they name themselves (``kvserve
        up --routers`` does); two that do not may share a rank, which costs the stagger
        between them (docs/internals.md, "Router replicas: taking turns"), nothing else."""
        own = (self.host, self.port)
        return sum(_address(url) < own for url in self.peer_urls)

    def kv_event_sources(self) -> tuple[KVEventSource, ...]:
        """Each worker URL's event source, by position."""
        if not self.kv_events:
            return (None,) * len(self.worker_urls)
        return tuple(parse_kv_event_source(value) for value in self.kv_events)

    @property
    def pd_mode(self) -> bool:
        return bool(self.decode_urls)

    def make_policy(self, now: float) -> Policy:
        """The policy named in this config, with its tuning."""
        return make_policy(
            self.policy,
            now,
            seed=self.seed,
            cache_aware=self.cache_aware,
            kv_aware=self.kv_aware,
            session_virtual_nodes=self.session_virtual_nodes,
        )

    def worker_headers(self) -> dict[str, str]:
        """Headers on every request to a worker: the fleet's key when it has one."""
        if self.worker_api_key is None:
            return {}
        return {"Authorization": f"Bearer {self.worker_api_key}"}


def _address(url: str) -> tuple[str, int]:
    """A peer's (host, port) from its URL, compared with this replica's own."""
    parts = urlsplit(url)
    default_port = 443 if parts.scheme == "https" else 80
    return parts.hostname or "", parts.port or default_port
