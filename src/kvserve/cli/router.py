"""``kvserve router``: the cache-aware gateway over a fleet of OpenAI-compatible workers."""

from __future__ import annotations

from typing import Annotated, Any, cast

import typer

from kvserve.cli.client_limit_options import (
    LIMITS,
    BodyTimeout,
    HeaderTimeout,
    MaxConnections,
    MaxHeaderBytes,
    limits_from_flags,
)

_TUNING = "Policy tuning"
_RELIABILITY = "Retries, circuit breaker, health checks"
_PD = "Prefill/decode disaggregation"


def _tuning(help: str) -> typer.models.OptionInfo:
    return cast(typer.models.OptionInfo, typer.Option(help=help, rich_help_panel=_TUNING))


def _reliability(help: str | None = None) -> typer.models.OptionInfo:
    return cast(typer.models.OptionInfo, typer.Option(help=help, rich_help_panel=_RELIABILITY))


def _pd_pool(role: str) -> typer.models.OptionInfo:
    return cast(
        typer.models.OptionInfo,
        typer.Option(
            help=f"PD mode: {role} worker URLs (repeat the flag, or A,B).", rich_help_panel=_PD
        ),
    )


def register(app: typer.Typer) -> None:
    @app.command(no_args_is_help=True)
    def router(
        worker_urls: Annotated[
            list[str] | None,
            typer.Option(
                "--worker-urls",
                help="Worker base URLs: --worker-urls URL [URL ...] (or repeat the flag).",
            ),
        ] = None,
        kv_events: Annotated[
            list[str] | None,
            typer.Option(
                "--kv-events",
                help="Per worker URL, by position: where to read its KV events. 'kvserve' "
                "(its HTTP stream, the default) or a ZMQ publisher in vLLM's format "
                "(vLLM, SGLang, kvserve --kv-events-publisher): tcp://host:port or "
                "ipc://path, optionally ?replay=tcp://host:port.",
            ),
        ] = None,
        more_values: Annotated[
            list[str] | None, typer.Argument(hidden=True, metavar="[URL]...")
        ] = None,
        prefill: Annotated[list[str] | None, _pd_pool("prefill")] = None,
        decode: Annotated[list[str] | None, _pd_pool("decode")] = None,
        policy: Annotated[
            str,
            typer.Option(
                help="cache_aware | kv_aware | round_robin | random | power_of_two | session "
                "| least_loaded; in PD mode it chooses the pair too (its own pair rule)."
            ),
        ] = "cache_aware",
        tokenizer: Annotated[
            str | None,
            _tuning(
                "kv_aware: model folder whose tokenizer and chat template hash prompts "
                "(default: the model a worker serves, when that is a local folder)."
            ),
        ] = None,
        peers: Annotated[
            list[str] | None,
            typer.Option(
                "--peers",
                help="Other router replicas of this fleet (repeat the flag, or A,B): this "
                "router announces its routing to them and applies theirs, so each sees the "
                "fleet's in-flight load (POST /peers/announcements; GET /peers shows them).",
            ),
        ] = None,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: Annotated[
            str | None, typer.Option(help="Required from clients on /v1/* when set.")
        ] = None,
        admin_api_key: Annotated[
            str | None,
            typer.Option(
                help="Required on /workers (the control plane) when set, else --api-key is. "
                "With neither, /workers answers loopback clients only."
            ),
        ] = None,
        worker_api_key: Annotated[
            str | None,
            typer.Option(
                help="Sent as 'Authorization: Bearer KEY' on every request to a worker "
                "(the workers' --api-key; one fleet shares one key)."
            ),
        ] = None,
        cache_threshold: Annotated[
            float, _tuning("cache_aware: matched fraction above which the match wins.")
        ] = 0.3,
        balance_abs_threshold: Annotated[
            int, _tuning("cache_aware: in-flight gap (max - min) that means imbalance.")
        ] = 64,
        balance_rel_threshold: Annotated[
            float, _tuning("cache_aware: and max > this x min means imbalance.")
        ] = 1.5,
        eviction_interval_secs: Annotated[
            float, _tuning("cache_aware: seconds between trims of the prefix tree.")
        ] = 60.0,
        max_tree_size: Annotated[
            int, _tuning("cache_aware: characters the whole prefix index may hold.")
        ] = 2**26,
        session_header: Annotated[
            str, _tuning("session: header keying the session (else the `user` field).")
        ] = "x-session-id",
        seed: Annotated[int | None, _tuning("random, power_of_two: RNG seed.")] = None,
        max_retries: Annotated[int, _reliability()] = 5,
        retry_initial_backoff: Annotated[float, _reliability("Seconds; x1.5 per retry.")] = 0.05,
        retry_max_backoff: Annotated[float, _reliability()] = 30.0,
        cb_failure_threshold: Annotated[int, _reliability()] = 10,
        cb_success_threshold: Annotated[int, _reliability()] = 3,
        cb_open: Annotated[float, _reliability("Seconds a tripped breaker stays open.")] = 60.0,
        health_check_interval: Annotated[float, _reliability()] = 60.0,
        health_check_timeout: Annotated[float, _reliability()] = 5.0,
        health_failure_threshold: Annotated[int, _reliability()] = 3,
        health_success_threshold: Annotated[int, _reliability()] = 2,
        request_timeout: Annotated[
            float, typer.Option(help="Seconds per attempt, streaming included.")
        ] = 1800.0,
        max_request_bytes: int = 32 * 1024 * 1024,
        processes: Annotated[
            int,
            typer.Option(
                help="Router processes serving the port (SO_REUSEPORT), sharing load and "
                "the policy's predictions: one per core to use (fixed worker set).",
            ),
        ] = 1,
        http_server: Annotated[
            str,
            typer.Option(
                help="lean (default): the OpenAI routes served by an httptools server "
                "beside the aiohttp app (router/lean_server.py); or aiohttp for all routes.",
                envvar="KVSERVE_ROUTER_HTTP_SERVER",
            ),
        ] = "lean",
        kv_block_size: Annotated[
            int | None,
            _tuning("kv_aware over ZMQ event sources: block size (default: from the events)."),
        ] = None,
        kv_prefill_token_s: Annotated[
            float | None,
            _tuning(
                "kv_aware: seconds a worker takes per uncached prompt token (default: "
                "Llama-3-8B on an H100). Calibrate for other engines and hardware."
            ),
        ] = None,
        kv_decode_request_s: Annotated[
            float | None,
            _tuning(
                "kv_aware: seconds each running request adds to a new prefill (default: "
                "5 ms, a GPU's; on a CPU a decode costs about what a prompt token does)."
            ),
        ] = None,
        kv_aware_recompute_weight: Annotated[
            float | None,
            _tuning(
                "kv_aware: score seconds per second of prefill a choice computes beyond the "
                "deepest holder's (default: the policy's own; see docs/internals.md)."
            ),
        ] = None,
        kv_aware_home_weight: Annotated[
            float | None,
            _tuning(
                "kv_aware: score seconds per second of a worker's wait, times the share of "
                "the prompt computed there (a prefix's new home; it also scales the "
                "recompute weight by the holder's share; default: the policy's own)."
            ),
        ] = None,
        kv_aware_home_slack_queue: Annotated[
            float | None,
            _tuning(
                "kv_aware: the home weight applies only while the mean worker's guarded "
                "prefill is at most this many seconds (default: the policy's own; inf: "
                "always)."
            ),
        ] = None,
        kv_aware_recompute_slack_queue: Annotated[
            float | None,
            _tuning(
                "kv_aware: the recompute weight applies only while the mean worker's "
                "guarded prefill is at most this many seconds; past both bounds, TTFT "
                "alone ranks (default: the policy's own; inf: always)."
            ),
        ] = None,
        kv_aware_replica_spread: Annotated[
            float | None,
            _tuning(
                "kv_aware with --peers (not between --processes siblings): seconds of "
                "score each replica adds per worker at most, fixed per (replica, worker), "
                "so that near-equal choices differ across replicas (default: the policy's "
                "own; 0: none)."
            ),
        ] = None,
        kv_aware_replica_burst_window: Annotated[
            float | None,
            _tuning(
                "kv_aware with --peers: the salt and the stagger apply only while at "
                "least half of the last gaps between the requests this replica knows of "
                "(its own, its peers' announced) are under this many seconds (default: "
                "the policy's own; 0: every decision)."
            ),
        ] = None,
        kv_aware_replica_stagger: Annotated[
            float | None,
            _tuning(
                "kv_aware with --peers: in a burst, the replica ranked r among its peers "
                "(by address) chooses r times this many seconds after a request arrives, "
                "having heard the lower ranks' choices (default: the policy's own; 0: "
                "every replica chooses at once)."
            ),
        ] = None,
        kv_aware_retention_margin: Annotated[
            float | None,
            _tuning(
                "kv_aware: the recompute weight falls to 0 as the holder's predicted wait "
                "nears 1/margin of its cache's retention time (0: no discount)."
            ),
        ] = None,
        kv_aware_retention_window: Annotated[
            float | None,
            _tuning("kv_aware: seconds over which a worker's eviction rate is averaged."),
        ] = None,
        header_timeout: HeaderTimeout = LIMITS.header_timeout_s,
        body_timeout: BodyTimeout = LIMITS.body_timeout_s,
        max_header_bytes: MaxHeaderBytes = LIMITS.max_header_bytes,
        max_connections: MaxConnections = LIMITS.max_connections,
    ) -> None:
        """Route OpenAI requests over workers (defaults match sglang-router's)."""
        from kvserve.core.routing.cache_aware import CacheAwareConfig
        from kvserve.core.routing.kv_aware import KvAwareConfig
        from kvserve.router import RouterConfig, run_router
        from kvserve.router.config import CircuitBreakerConfig, HealthCheckConfig, RetryConfig

        # ``--worker-urls A B --kv-events X Y``: the values after the first of each flag
        # arrive here, told apart by their scheme.
        extra = more_values or []
        extra_sources = [v for v in extra if not v.startswith(("http://", "https://"))]
        # kv_aware's flags given (None: the policy's own default)
        kv_aware_flags = {
            "prefill_token_s": kv_prefill_token_s,
            "decode_request_s": kv_decode_request_s,
            "recompute_weight": kv_aware_recompute_weight,
            "retention_margin": kv_aware_retention_margin,
            "retention_window_s": kv_aware_retention_window,
            "replica_spread_s": kv_aware_replica_spread,
            "replica_burst_window_s": kv_aware_replica_burst_window,
            "replica_stagger_s": kv_aware_replica_stagger,
            "home_weight": kv_aware_home_weight,
            "home_slack_queue_s": kv_aware_home_slack_queue,
            "recompute_slack_queue_s": kv_aware_recompute_slack_queue,
        }
        kv_aware_given: dict[str, Any] = {k: v for k, v in kv_aware_flags.items() if v is not None}
        try:
            config = RouterConfig(
                worker_urls=(
                    *(worker_urls or ()),
                    *(v for v in extra if v.startswith(("http://", "https://"))),
                ),
                kv_events=(*(kv_events or ()), *extra_sources),
                kv_block_size=kv_block_size,
                prefill_urls=_url_list(prefill),
                decode_urls=_url_list(decode),
                policy=policy,
                host=host,
                port=port,
                api_key=api_key,
                admin_api_key=admin_api_key,
                worker_api_key=worker_api_key,
                cache_aware=CacheAwareConfig(
                    cache_threshold=cache_threshold,
                    balance_abs_threshold=balance_abs_threshold,
                    balance_rel_threshold=balance_rel_threshold,
                    eviction_interval_s=eviction_interval_secs,
                    max_tree_size=max_tree_size,
                ),
                kv_aware=KvAwareConfig(**kv_aware_given),
                session_header=session_header,
                tokenizer=tokenizer,
                seed=seed,
                peer_urls=_url_list(peers),
                retry=RetryConfig(
                    max_retries=max_retries,
                    initial_backoff_s=retry_initial_backoff,
                    max_backoff_s=retry_max_backoff,
                ),
                circuit_breaker=CircuitBreakerConfig(
                    failure_threshold=cb_failure_threshold,
                    success_threshold=cb_success_threshold,
                    open_s=cb_open,
                ),
                health=HealthCheckConfig(
                    interval_s=health_check_interval,
                    timeout_s=health_check_timeout,
                    failure_threshold=health_failure_threshold,
                    success_threshold=health_success_threshold,
                ),
                request_timeout_s=request_timeout,
                max_request_bytes=max_request_bytes,
                processes=processes,
                http_server=http_server,
                client_limits=limits_from_flags(
                    header_timeout, body_timeout, max_header_bytes, max_connections
                ),
            )
        except ValueError as error:
            raise typer.BadParameter(str(error)) from error
        run_router(config)


def _url_list(values: list[str] | None) -> tuple[str, ...]:
    """Repeated flags and comma-separated lists alike."""
    return tuple(url for value in values or () for url in value.split(",") if url)
